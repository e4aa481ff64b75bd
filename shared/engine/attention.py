"""Per-step attention metadata, and the two ways decode tokens attend to the paged pool.

A step's tokens are flattened into one [T, hidden] batch for the dense layers. Attention runs
per prefill segment (causal over its own context) and once for all decode tokens together
(each attends its request's whole context in the paged pool).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from shared.engine.kernels import cpu_kernels
from shared.engine.kv_cache import KVCache


@dataclass(frozen=True)
class PrefillSegment:
    start: int  # first row of this segment in the flattened batch
    length: int  # new tokens computed this step
    cached: int  # tokens of this request already in the KV pool (chunked prefill)
    block_table: torch.Tensor  # [num_blocks] long, covering cached + length


@dataclass(frozen=True)
class DecodeGroup:
    start: int  # decode rows are contiguous at the end of the flattened batch
    block_tables: torch.Tensor  # [B, max_blocks] long, padded with block 0
    context_lens: torch.Tensor  # [B] long, keys each row attends to (its new token included)
    mask: torch.Tensor  # [B, 1, 1, max_blocks*block_size] bool, True where a key is valid

    @classmethod
    def of(cls, start: int, block_tables: torch.Tensor, context_lens: torch.Tensor,
           block_size: int) -> DecodeGroup:
        keys = torch.arange(block_tables.shape[1] * block_size, device=block_tables.device)
        mask = (keys.unsqueeze(0) < context_lens.unsqueeze(1))[:, None, None, :]
        return cls(start, block_tables, context_lens, mask)


@dataclass(frozen=True)
class AttentionMetadata:
    slots: torch.Tensor  # [T] pool slot (block * block_size + offset) of each new token's K/V
    prefills: list[PrefillSegment]
    decode: DecodeGroup | None


# (layer, queries [B, H, D], decode group, pool) -> [B, H*D]
DecodeAttention = Callable[[int, torch.Tensor, DecodeGroup, KVCache], torch.Tensor]


# SDPA's kernels for decode's masked attention on a GPU: with a mask it would pick cuDNN on
# Hopper, whose host-side cost a call (~130 us, as its plan follows the growing context) made
# a batch-1 Llama-3-8B step on an H200 1.6x slower than the memory-efficient kernel's
GPU_DECODE_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def gather_decode_attention(layer: int, q: torch.Tensor, group: DecodeGroup,
                            kv: KVCache) -> torch.Tensor:
    """Gather the batch's blocks into [B, L, H_kv, D] and run SDPA (any device)."""
    keys, values = (t.to(q.dtype) for t in kv.gather(layer, group.block_tables))
    # The query heads sharing a KV head become that head's query rows ([B, H_kv, G, D]),
    # so every key and value is read once, not once per query head.
    b, heads, dim = q.shape
    kv_heads = keys.shape[2]
    qg = q.view(b, kv_heads, heads // kv_heads, dim)
    with sdpa_kernel(GPU_DECODE_BACKENDS) if q.is_cuda else contextlib.nullcontext():
        o = F.scaled_dot_product_attention(
            qg, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=group.mask)
    return o.reshape(b, -1)


def paged_decode_attention(layer: int, q: torch.Tensor, group: DecodeGroup,
                           kv: KVCache) -> torch.Tensor:
    """Read K/V in place from the pool with the C++ kernel (CPU): no gather copy."""
    kernel = cpu_kernels()
    assert kernel is not None
    keys, values = kv.data[layer, 0], kv.data[layer, 1]
    out = kernel.paged_decode_attention(q.to(keys.dtype), keys, values, group.block_tables,
                                        group.context_lens, q.shape[-1] ** -0.5)
    return out.reshape(q.shape[0], -1).to(q.dtype)  # type: ignore[no-any-return]


def pick_decode_attention(device: torch.device) -> DecodeAttention:
    if device.type == "cpu" and cpu_kernels() is not None:
        return paged_decode_attention
    return gather_decode_attention
