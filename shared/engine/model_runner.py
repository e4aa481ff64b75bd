"""The only code that touches the device: loads the model, owns the KV pool, turns a
SchedulerOutput into tensors, runs the forward pass and samples."""

from __future__ import annotations

import torch

from shared.engine import loader
from shared.engine.attention import (
    AttentionMetadata,
    DecodeGroup,
    PrefillSegment,
    pick_decode_attention,
)
from shared.engine.config import EngineConfig, ModelConfig
from shared.engine.kv_cache import KVCache
from shared.engine.loader import LoadedModel
from shared.engine.sampler import sample
from shared.engine.scheduler import ScheduledChunk, SchedulerOutput

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def bf16_native(device: torch.device) -> bool:
    """Whether the GPU computes in bfloat16 itself (Ampere on), not by emulation."""
    return torch.cuda.get_device_capability(device) >= (8, 0)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if bf16_native(device) else torch.float16
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: choose one of {sorted(DTYPES)}")
    if DTYPES[name] is torch.bfloat16 and device.type == "cuda" and not bf16_native(device):
        raise ValueError(f"{device} cannot compute in bfloat16: use --dtype float16 or float32")
    return DTYPES[name]


def load_model(config: EngineConfig) -> LoadedModel:
    """The model named in `config` (a Hugging Face directory, a GGUF, or a Llama shape with
    random weights) on its device, in its dtype, with its tokenizer."""
    device = resolve_device(config.device)
    return loader.load(config.model, config.seed, device, resolve_dtype(config.dtype, device),
                       config.weights)


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        """`loaded` lets several engines (roles, tests, benchmarks) share one model copy."""
        if config.threads > 0:
            torch.set_num_threads(config.threads)
        self.model, self.tokenizer = loaded if loaded is not None else load_model(config)
        self.device, self.dtype = self.model.device, self.model.dtype
        self.model.decode_attention = pick_decode_attention(self.device)
        self.kv = KVCache.from_budget(self.model.config, config.kv_cache_bytes,
                                      config.scheduler.block_size, self.dtype, self.device)

    @property
    def model_config(self) -> ModelConfig:
        return self.model.config

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, tuple[int, float | None]]:
        """Run one step; return the sampled token (and logprob) of each request that samples."""
        ids, positions, meta = self._prepare(out)
        hidden = self.model.forward(ids, positions, meta, self.kv)
        rows, sampling = [], []
        row = 0
        for chunk in out.chunks:
            row += chunk.length
            if chunk.samples:
                rows.append(row - 1)
                sampling.append(chunk)
        if not sampling:
            return {}
        logits = self.model.logits(hidden[torch.tensor(rows, device=self.device)])
        tokens, logprobs = sample(logits, [c.request.params for c in sampling],
                                  [len(c.request.output_ids) for c in sampling])
        return {c.request.request_id: (t, lp)
                for c, t, lp in zip(sampling, tokens, logprobs, strict=True)}

    def _prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor,
                                                      AttentionMetadata]:
        bs = self.kv.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for chunk in out.chunks:
            request = chunk.request
            span = range(chunk.start, chunk.start + chunk.length)
            ids.extend(request.token_span(chunk.start, chunk.start + chunk.length))
            positions.extend(span)
            slots.extend(request.block_table[p // bs] * bs + p % bs for p in span)
        meta = AttentionMetadata(
            slots=self._tensor(slots),
            prefills=self._prefill_segments(out.prefills),
            decode=self._decode_group(out.decodes, len(ids) - len(out.decodes)),
        )
        return self._tensor(ids), self._tensor(positions), meta

    def _prefill_segments(self, chunks: list[ScheduledChunk]) -> list[PrefillSegment]:
        segments, start = [], 0
        for chunk in chunks:
            table = self._tensor(chunk.request.block_table) if chunk.start else self._empty
            segments.append(PrefillSegment(start, chunk.length, chunk.start, table))
            start += chunk.length
        return segments

    def _decode_group(self, chunks: list[ScheduledChunk], start: int) -> DecodeGroup | None:
        if not chunks:
            return None
        width = max(len(c.request.block_table) for c in chunks)
        tables = [c.request.block_table + [0] * (width - len(c.request.block_table))
                  for c in chunks]
        lengths = self._tensor([c.start + 1 for c in chunks])
        keys = torch.arange(width * self.kv.block_size, device=self.device)
        mask = (keys.unsqueeze(0) < lengths.unsqueeze(1))[:, None, None, :]
        return DecodeGroup(start, self._tensor(tables), lengths, mask)

    def _tensor(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    @property
    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.long, device=self.device)
