"""A GGUF file's weights for the engine: dequantized to float32, or (`keep_blocks`) its
quantized blocks read as they are; Q/K rows returned from llama.cpp's RoPE order."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf.quants import dequantize

from shared.engine.config import ModelConfig
from shared.engine.gguf_file import GgufFile, GgufTensor
from shared.engine.gguf_loader import (
    TokenizerData,
    config_of,
    resolve_gguf_path,
    tokenizer_of,
)
from shared.engine.quant import GGUF_BLOCKS, QuantizedMatrix, from_gguf_blocks


@dataclass(frozen=True)
class GGUFModel:
    config: ModelConfig
    # HF-style names, float32 or (`keep_blocks`) quantized as stored, (out, in) for matrices
    weights: dict[str, np.ndarray | QuantizedMatrix]
    tokenizer: TokenizerData


def _unpermute_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp stores Q/K rows interleaved for its RoPE; return them to the half-split
    layout (rotate_half) that the HF reference and our model use."""
    rows = weight.shape[0]
    w = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return np.ascontiguousarray(w.swapaxes(1, 2).reshape(weight.shape))


_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_output": "o_proj",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
    "attn_q_norm": "q_norm",
    "attn_k_norm": "k_norm",
}
_GLOBAL_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}


def _engine_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk" and parts[-1] == "bias":  # blk.0.attn_q.bias -> layers.0.q_bias
        return f"layers.{parts[1]}.{_LAYER_NAMES[parts[2]][0]}_bias"
    if parts[0] == "blk":
        return f"layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return _GLOBAL_NAMES[parts[0]]


def _kept(tensor: GgufTensor, keep_blocks: int | None) -> bool:
    """Whether `tensor`'s blocks are read as they are: the format asked for (Q4_0/Q4_1 for 4
    bits, Q8_0 for 8), or Q8_0 under 4 bits (the LM head is int8 either way)."""
    kind = GGUF_BLOCKS.get(tensor.tensor_type.name)
    return keep_blocks is not None and kind is not None and kind[0] >= keep_blocks


def _dequantized(tensor: GgufTensor) -> np.ndarray:
    """A float32 copy of `tensor` (F32 tensors are read-only views of the mapped file).
    Q4_1 and Q8_0 blocks decode in torch, bit for bit as gguf-py's NumPy does, at twice its
    speed; other types through gguf-py."""
    kind = tensor.tensor_type.name
    if kind in ("Q4_1", "Q8_0") and tensor.data.ndim == 2:  # (rows, bytes a row)
        return from_gguf_blocks(tensor.data, kind).dequantize().numpy()
    return np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)


def _read_weights(reader: GgufFile, config: ModelConfig,
                  keep_blocks: int | None) -> dict[str, np.ndarray | QuantizedMatrix]:
    weights: dict[str, np.ndarray | QuantizedMatrix] = {}
    for tensor in reader.tensors:
        name = _engine_name(tensor.name)
        heads = (config.num_heads if name.endswith(("q_proj", "q_bias")) else
                 config.num_kv_heads if name.endswith(("k_proj", "k_bias")) else 0)
        # llama.cpp permutes Llama's Q/K rows only
        unpermute = config.architecture == "llama" and heads > 0
        if _kept(tensor, keep_blocks):
            blocks = from_gguf_blocks(tensor.data, tensor.tensor_type.name)
            if unpermute:  # the same row order, as an index
                order = _unpermute_rope(np.arange(blocks.shape[0]), heads)
                blocks = blocks.rows(torch.from_numpy(order))
            weights[name] = blocks
            continue
        array = _dequantized(tensor)
        weights[name] = _unpermute_rope(array, heads) if unpermute else array
    return weights


def load_gguf(model: str, keep_blocks: int | None = None) -> GGUFModel:
    """`keep_blocks` (8 or 4): matrices stored in blocks of that many bits (or more) are read
    as they are, not dequantized."""
    path = resolve_gguf_path(model)
    reader = GgufFile(path)
    config = config_of(reader, model)
    return GGUFModel(config, _read_weights(reader, config, keep_blocks), tokenizer_of(reader))
