"""Per-step attention metadata: where each scheduled token's K/V goes and what it attends to.

A step's tokens are flattened into one [T, hidden] batch for the dense layers. Attention runs
per prefill segment (causal over its own context) and once for all decode tokens together
(each attends its request's whole context, gathered from the paged pool).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    mask: torch.Tensor  # [B, 1, 1, max_blocks*block_size] bool, True where a key is valid


@dataclass(frozen=True)
class AttentionMetadata:
    slots: torch.Tensor  # [T] pool slot (block * block_size + offset) of each new token's K/V
    prefills: list[PrefillSegment]
    decode: DecodeGroup | None
