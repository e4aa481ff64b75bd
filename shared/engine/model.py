"""A Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over the paged KV
pool: Llama, Mistral, Qwen2 (Q/K/V bias) and Qwen3 (per-head Q/K norm). Weights are plain
tensors (float32 on the CPU: packed in panels for the CPU's float matmul), or (`weight_bits`)
int8/int4 blocks in panels for the CPU's quantized matmul; Q/K/V and gate/up are fused into one
matmul each."""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from shared.engine.attention import (
    AttentionMetadata,
    DecodeAttention,
    PrefillSegment,
    gather_decode_attention,
    paged_decode_attention,
)
from shared.engine.config import ModelConfig, RopeScaling
from shared.engine.kernels import cpu_kernels
from shared.engine.kv_cache import KVCache
from shared.engine.panels import PanelMatrix, packable
from shared.engine.parallel.layout import RankPlace, check_tp, shard_config
from shared.engine.parallel.sharding import ShardedWeights
from shared.engine.quant import NO_MINS, QuantizedMatrix, QuantizedPanels, matmul, stack_rows

# float [in, out], or (out, in) in float32 panels (CPU) or quantized blocks
Matrix = torch.Tensor | PanelMatrix | QuantizedPanels
WHOLE = RankPlace()  # the whole model in one rank
# rows of a prompt chunk over cached context that attend in one call: its mask is a tile's
# rows by the keys they reach (a 32k-token prompt found one block in the prefix cache would
# otherwise build a 1 GiB mask a layer), and a tile reads no key past its last row's
QUERY_TILE = 512
Weights = Mapping[str, torch.Tensor | QuantizedMatrix]


@dataclass(frozen=True)
class LayerWeights:
    """Float32 matrices on the CPU are packed in panels (the engine's own kernel: BLAS reads
    a decode step's skinny GEMMs' weights at half the memory bandwidth or less on some CPUs);
    other float ones stored [in, out] (x @ w); quantized ones in the kernel's panels of 16
    output columns (quant.QuantizedPanels)."""

    input_norm: torch.Tensor
    qkv: Matrix  # q_size + 2*kv_size outputs of hidden inputs
    o: Matrix
    post_norm: torch.Tensor
    gate_up: Matrix  # 2*intermediate outputs
    down: Matrix
    qkv_bias: torch.Tensor | None = None  # [q_size + 2*kv_size] (Qwen2)
    qk_norm: torch.Tensor | None = None  # [heads + kv_heads, head_dim]: each head's norm (Qwen3)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """RoPE's inverse frequencies ([head_dim / 2]), scaled as the model was trained to."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq.float()
    if scaling.kind == "linear":
        return (inv_freq / scaling.factor).float()
    # llama3: wavelengths longer than the original context / low_freq_factor are divided by
    # the factor, shorter than it / high_freq_factor kept, the band between blended
    wavelen = 2 * math.pi / inv_freq
    old = scaling.original_max_context
    smooth = (old / wavelen - scaling.low_freq_factor) / \
        (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > old / scaling.low_freq_factor, inv_freq / scaling.factor,
                         torch.where(wavelen < old / scaling.high_freq_factor, inv_freq, blended))
    return scaled.float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RandomWeights(Mapping[str, torch.Tensor]):
    """A model's weights drawn at random (norms 1), each from a seed of its own name when it
    is read: the same seed gives the same weights in every process, one tensor at a time."""

    def __init__(self, config: ModelConfig, seed: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.seed, self.device, self.dtype = seed, device, dtype
        h, i, q, kv = config.hidden_size, config.intermediate_size, config.q_size, config.kv_size
        layer: dict[str, tuple[int, ...]] = {
            "q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i),
            "input_layernorm": (h,), "post_attention_layernorm": (h,)}
        if config.qkv_bias:
            layer |= {"q_bias": (q,), "k_bias": (kv,), "v_bias": (kv,)}
        if config.qk_norm:
            layer |= {"q_norm": (config.head_dim,), "k_norm": (config.head_dim,)}
        self.shapes = {"embed_tokens": (config.vocab_size, h), "norm": (h,)}
        if not config.tie_embeddings:
            self.shapes["lm_head"] = (config.vocab_size, h)
        self.shapes |= {f"layers.{n}.{name}": shape for n in range(config.num_layers)
                        for name, shape in layer.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        if name.endswith("norm"):
            return torch.ones(shape, device=self.device, dtype=self.dtype)
        gen = torch.Generator(device=self.device).manual_seed(
            self.seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.randn(shape, generator=gen, device=self.device, dtype=self.dtype) * 0.02

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: Weights, device: torch.device | None = None,
                 dtype: torch.dtype | None = None, weight_bits: int | None = None,
                 place: RankPlace = WHOLE) -> None:
        """`weights` by the engine's names, in any dtype and on any device: each is read once
        and placed on `device` in `dtype` (default: the final norm's), so a lazy mapping over
        a checkpoint's files is loaded one tensor at a time. With `weight_bits` (8 or 4) the
        layers' matrices are quantized (blocks already quantized so, a GGUF's, kept as they
        are) and the LM head is int8; activations, norms and the embedding stay float32.
        `place`: the rank's part of an instance of several (parallel.layout; the weights cut by
        parallel.sharding): its stage's
        layers and, with tp > 1, its share of their heads and MLP columns (`shard`); the
        embedding on the first stage, the LM head on rank 0 only, which samples."""
        self.config = config  # the whole model's shape
        self.place, self.weight_bits = place, weight_bits
        self.layer_ids = place.layers(config.num_layers)
        shard = shard_config(config, place.tp) if place.tp > 1 else config
        # what this rank computes: its layers, its heads
        self.shard = dataclasses.replace(shard, num_layers=len(self.layer_ids))
        # tp > 1: sums the stage's partial outputs of the output and down projections
        self.all_reduce: Callable[[torch.Tensor], None] | None = None
        if place.tp > 1:
            check_tp(config, place.tp, quantized=weight_bits is not None)
            weights = ShardedWeights(weights, config, place.tp_rank, place.tp)
        # how decode tokens attend to the pool; the model runner picks the best for its device
        self.decode_attention: DecodeAttention = gather_decode_attention
        norm = weights["norm"]
        assert isinstance(norm, torch.Tensor), "only matrices come quantized"
        self.device, self.dtype = device or norm.device, dtype or norm.dtype
        if weight_bits is not None:
            self._check_quantizable()
        self.packed = weight_bits is None and packable(self.device, self.dtype)
        # norms, SwiGLU and RoPE in one compiled call each on the CPU (torch: 4-8 operators)
        self.ops = cpu_kernels() if self.device.type == "cpu" and self.dtype == torch.float32 \
            else None
        self.norm = self._place(norm)
        # a tied embedding packed for the LM head is read from its panels: one copy
        self.embed: torch.Tensor | PanelMatrix | None = None
        self.lm_head: Matrix | None = None
        if place.first:
            embed = weights["embed_tokens"]
            if place.rank == 0:
                self.lm_head = self._head(embed if config.tie_embeddings else weights["lm_head"])
            if config.tie_embeddings and isinstance(self.lm_head, torch.Tensor | PanelMatrix):
                self.embed = self.lm_head
            else:
                self.embed = self._place(embed)
            del embed  # the checkpoint's copy, when it was cast: not held through the load
        self.layers = [self._layer(weights, f"layers.{i}.") for i in self.layer_ids]
        # a decode step's layers in one compiled call (kernels/decode_layers.cpp) where they
        # can take it; False runs them one operation at a time, as every other step
        self.fused_decode = True
        self.fused_layers = self._fusable_layers()
        inv_freq = rope_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        freqs = torch.outer(torch.arange(config.max_context, dtype=torch.float32), inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        self.cos = angles.cos().to(self.device, self.dtype)
        self.sin = angles.sin().to(self.device, self.dtype)

    def _head(self, head: torch.Tensor | QuantizedMatrix) -> Matrix:
        """The LM head: int8 with quantized weights, else as the layers' matrices are (a
        plain one (vocab, hidden), the embedding's layout)."""
        if self.weight_bits is not None:
            return QuantizedPanels.pack(stack_rows([head], 8))
        return self._packed(head) if self.packed else self._place(head)

    @staticmethod
    def _packed(*parts: torch.Tensor | QuantizedMatrix) -> PanelMatrix:
        """Parts cast while copied into their panels (a checkpoint's bf16 part is not first
        copied whole to float32)."""
        return PanelMatrix.pack(*(p.dequantize() if isinstance(p, QuantizedMatrix) else p
                                  for p in parts))

    def _check_quantizable(self) -> None:
        if self.device.type != "cpu" or self.dtype != torch.float32:
            raise ValueError(f"quantized weights run on the CPU in float32, not {self.device} "
                             f"{self.dtype}")
        if cpu_kernels() is None:
            raise ValueError("quantized weights need the compiled CPU kernels (a C++ compiler)")

    def _place(self, tensor: torch.Tensor | QuantizedMatrix) -> torch.Tensor:
        if isinstance(tensor, QuantizedMatrix):  # a GGUF's quantized embedding
            tensor = tensor.dequantize()
        return tensor.to(self.device, self.dtype)

    def _matrix(self, *parts: torch.Tensor | QuantizedMatrix) -> Matrix:
        """One matrix of (out, in) parts stacked by rows: quantized, packed in panels, or
        [in, out] floats with each part copied (and cast) once into its columns, not cast,
        concatenated and transposed in three passes."""
        if self.weight_bits is not None:
            return QuantizedPanels.pack(stack_rows(parts, self.weight_bits))
        if self.packed:
            return self._packed(*parts)
        out = torch.empty(parts[0].shape[1], sum(p.shape[0] for p in parts),
                          device=self.device, dtype=self.dtype)
        column = 0
        for part in parts:
            assert isinstance(part, torch.Tensor), "blocks are kept only for quantized weights"
            out[:, column:column + part.shape[0]].copy_(part.t())
            column += part.shape[0]
        return out

    def weight_bytes(self) -> int:
        """Bytes a decode step reads: every layer's weights and the LM head (of the
        embedding, a few rows)."""
        def size(t: Matrix | None) -> int:
            return 0 if t is None else t.nbytes
        per_layer = [size(getattr(layer, f.name)) for layer in self.layers
                     for f in dataclasses.fields(layer)]
        return sum(per_layer) + size(self.lm_head) + size(self.norm)

    def _layer(self, w: Weights, p: str) -> LayerWeights:
        config = self.shard

        def vector(name: str) -> torch.Tensor:
            tensor = w[p + name]
            assert isinstance(tensor, torch.Tensor), "only matrices come quantized"
            return tensor

        qk_norm = qkv_bias = None
        if config.qk_norm:  # one weight per head, Q heads then K heads as the fused view
            qk_norm = self._place(torch.cat([vector("q_norm").expand(config.num_heads, -1),
                                             vector("k_norm").expand(config.num_kv_heads, -1)]))
        if config.qkv_bias:
            qkv_bias = self._place(torch.cat([vector("q_bias"), vector("k_bias"),
                                              vector("v_bias")]))
        return LayerWeights(
            input_norm=self._place(w[p + "input_layernorm"]),
            qkv=self._matrix(w[p + "q_proj"], w[p + "k_proj"], w[p + "v_proj"]),
            o=self._matrix(w[p + "o_proj"]),
            post_norm=self._place(w[p + "post_attention_layernorm"]),
            gate_up=self._matrix(w[p + "gate_proj"], w[p + "up_proj"]),
            down=self._matrix(w[p + "down_proj"]),
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
        )

    @classmethod
    def from_numpy(cls, config: ModelConfig, weights: Mapping[str, np.ndarray | QuantizedMatrix],
                   device: torch.device, dtype: torch.dtype, weight_bits: int | None = None,
                   place: RankPlace = WHOLE) -> LlamaModel:
        return cls(config, {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
                            for k, v in weights.items()}, device, dtype, weight_bits, place)

    @classmethod
    def random(cls, config: ModelConfig, seed: int, device: torch.device,
               dtype: torch.dtype, weight_bits: int | None = None,
               place: RankPlace = WHOLE) -> LlamaModel:
        """Random weights of the right shapes, for profiling at realistic sizes (each drawn
        from its own seed when read, so every rank of an instance draws the same ones)."""
        return cls(config, RandomWeights(config, seed, device, dtype), device, dtype,
                   weight_bits, place)

    def _fusable_layers(self) -> tuple[list[torch.Tensor], list[int]] | None:
        """The layers' weights as `decode_layers` takes them (per layer its two norms, then
        each matrix's weights, scales and minimums; each one's bits and width), or None where
        a layer needs what it does not do: Q/K/V biases, per-head norms, plain float matrices
        (a GPU's), or no compiled kernels."""
        if self.ops is None:
            return None
        tensors: list[torch.Tensor] = []
        shapes: list[int] = []
        for layer in self.layers:
            if layer.qkv_bias is not None or layer.qk_norm is not None:
                return None
            tensors += [layer.input_norm, layer.post_norm]
            for m in (layer.qkv, layer.o, layer.gate_up, layer.down):
                if isinstance(m, PanelMatrix):
                    tensors += [m.panels, NO_MINS, NO_MINS]
                    shapes += [32, m.out_features]
                elif isinstance(m, QuantizedPanels):
                    tensors += [m.weights, m.scales, NO_MINS if m.mins is None else m.mins]
                    shapes += [m.bits, m.out_features]
                else:
                    return None
        return tensors, shapes

    def _fuses(self, meta: AttentionMetadata) -> bool:
        """Whether this step's layers run as one call: a decode-only step on one rank's whole
        heads, attending with the paged kernel."""
        return (self.fused_decode and self.fused_layers is not None and self.all_reduce is None
                and not meta.prefills and meta.decode is not None and meta.decode.start == 0
                and self.decode_attention is paged_decode_attention)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv: KVCache,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states ([T, hidden]) of a flattened batch after this rank's layers (the
        final norm applied on the last stage); writes the new K/V into `kv`. `hidden`: the
        previous stage's output (the first stage embeds `token_ids` instead)."""
        cfg = self.shard
        if hidden is None:
            assert self.embed is not None, "only the first stage embeds tokens"
            x = (F.embedding(token_ids, self.embed) if isinstance(self.embed, torch.Tensor)
                 else self.embed.rows(token_ids))
        else:
            x = hidden
        if self._fuses(meta):
            assert self.ops is not None and self.fused_layers is not None
            assert meta.decode is not None
            tensors, shapes = self.fused_layers
            x = self.ops.decode_layers(
                x.contiguous() if hidden is None else x.clone(
                    memory_format=torch.contiguous_format), tensors, shapes, kv.data,
                positions, meta.slots, meta.decode.block_tables, meta.decode.context_lens,
                self.cos, self.sin, cfg.num_heads, cfg.rms_norm_eps, cfg.head_dim ** -0.5)
            return x if not self.place.last else self._rms_norm(x, self.norm)
        for index, layer in enumerate(self.layers):
            h = self._rms_norm(x, layer.input_norm)
            if layer.qkv_bias is None:
                qkv = matmul(h, layer.qkv)
            elif isinstance(layer.qkv, torch.Tensor):
                qkv = torch.addmm(layer.qkv_bias, h, layer.qkv)
            else:
                qkv = matmul(h, layer.qkv) + layer.qkv_bias
            qk, v = torch.split(qkv, [cfg.q_size + cfg.kv_size, cfg.kv_size], -1)
            qk = qk.view(-1, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
            if layer.qk_norm is not None:
                qk = F.rms_norm(qk, (cfg.head_dim,), eps=cfg.rms_norm_eps) * layer.qk_norm
            qk = self._rope(qk, positions)  # on Q and K heads at once
            q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
            v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
            kv.write(index, k, v, meta.slots)
            attn = self._attention(index, q, k, v, meta, kv)
            x = x + self._reduced(matmul(attn, layer.o))
            h = self._rms_norm(x, layer.post_norm)
            x = x + self._reduced(matmul(self._swiglu(matmul(h, layer.gate_up)), layer.down))
        if not self.place.last:
            return x
        return self._rms_norm(x, self.norm)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.rms_norm(x, weight, self.shard.rms_norm_eps)  # type: ignore[no-any-return]
        return F.rms_norm(x, (self.shard.hidden_size,), weight, self.shard.rms_norm_eps)

    def _swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.silu_mul(gate_up)  # type: ignore[no-any-return]
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _rope(self, qk: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """RoPE on [tokens, heads, head_dim] (in place where compiled: a view of the step's
        fused QKV output, which nothing else reads)."""
        if self.ops is not None:
            self.ops.rope(qk, self.cos, self.sin, positions)
            return qk
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        return qk * cos + _rotate_half(qk) * sin

    def _reduced(self, partial: torch.Tensor) -> torch.Tensor:
        if self.all_reduce is not None:
            self.all_reduce(partial)
        return partial

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "only rank 0 samples"
        if isinstance(self.lm_head, torch.Tensor):  # (vocab, hidden), the embedding's layout
            return F.linear(hidden, self.lm_head).float()
        return matmul(hidden, self.lm_head)

    def _attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   meta: AttentionMetadata, kv: KVCache) -> torch.Tensor:
        if not meta.prefills and meta.decode is not None and meta.decode.start == 0:  # no copy
            return self.decode_attention(layer, q, meta.decode, kv)
        out = torch.empty(q.shape[0], self.shard.q_size, device=q.device, dtype=q.dtype)
        for seg in meta.prefills:
            rows = slice(seg.start, seg.start + seg.length)
            out[rows] = self._prefill_attention(layer, q[rows], k[rows], v[rows], seg, kv)
        if meta.decode is not None:
            out[meta.decode.start:] = self.decode_attention(
                layer, q[meta.decode.start:], meta.decode, kv)
        return out

    def _prefill_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           seg: PrefillSegment, kv: KVCache) -> torch.Tensor:
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if seg.cached == 0:  # the whole context is the new tokens: no gather needed
            o = F.scaled_dot_product_attention(
                qh, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                is_causal=True, enable_gqa=True)
        else:
            total = seg.cached + seg.length
            keys, values = kv.gather(layer, seg.block_table.unsqueeze(0))
            kh, vh = (t[:, :total].transpose(1, 2).to(q.dtype) for t in (keys, values))
            tiles = []
            for first in range(0, seg.length, QUERY_TILE):
                end = min(seg.length, first + QUERY_TILE)
                reach = seg.cached + end  # the keys the tile's last row attends to
                rows = torch.arange(first, end, device=q.device).unsqueeze(1) + seg.cached
                mask = torch.arange(reach, device=q.device).unsqueeze(0) <= rows
                tiles.append(F.scaled_dot_product_attention(
                    qh[:, :, first:end], kh[:, :, :reach], vh[:, :, :reach], attn_mask=mask,
                    enable_gqa=True))
            o = tiles[0] if len(tiles) == 1 else torch.cat(tiles, dim=2)
        return o.squeeze(0).transpose(0, 1).reshape(seg.length, -1)
