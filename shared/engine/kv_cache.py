"""The paged KV pool on the device: one tensor of fixed-size blocks.

Layout is block-major, [num_blocks, num_layers, 2 (K, V), block_size, kv_heads, head_dim], so
one block of one request is a single contiguous region: exporting a request is a gather of
whole blocks, and a transfer can send them as they lie.
"""

from __future__ import annotations

import torch

from shared.engine.config import ModelConfig


def block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return block_size * config.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size())


class KVCache:
    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        assert num_blocks > 0, "the KV budget does not hold a single block"
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks, config.num_layers, 2, block_size, config.num_kv_heads,
                 config.head_dim)
        self.data = torch.zeros(shape, dtype=dtype, device=device)

    @classmethod
    def from_budget(
        cls, config: ModelConfig, budget_bytes: int, block_size: int,
        dtype: torch.dtype, device: torch.device,
    ) -> KVCache:
        return cls(config, budget_bytes // block_bytes(config, block_size, dtype), block_size,
                   dtype, device)

    @property
    def bytes_per_block(self) -> int:
        return self.data[0].numel() * self.data.element_size()

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor,
              blocks: torch.Tensor, offsets: torch.Tensor) -> None:
        """Store K/V of new tokens ([T, kv_heads, head_dim]) at (block, offset) slots."""
        self.data[blocks, layer, 0, offsets] = k
        self.data[blocks, layer, 1, offsets] = v

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole block tables ([B, max_blocks]) as [B, max_blocks*block_size, H, D]."""
        kv = self.data[block_tables, layer]  # [B, max_blocks, 2, block_size, H, D]
        b, n, _, s, h, d = kv.shape
        return (kv[:, :, 0].reshape(b, n * s, h, d), kv[:, :, 1].reshape(b, n * s, h, d))

    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A request's blocks as one contiguous buffer ([n, ...block shape])."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        return self.data.index_select(0, index)

    def import_blocks(self, block_ids: list[int], buffer: torch.Tensor) -> None:
        """Place exported blocks at (possibly different) block ids of this pool."""
        assert buffer.shape[0] == len(block_ids) and buffer.shape[1:] == self.data.shape[1:], (
            f"KV buffer shape {tuple(buffer.shape)} does not match pool blocks "
            f"{tuple(self.data.shape[1:])}"
        )
        index = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        self.data.index_copy_(0, index, buffer.to(self.data.device, self.data.dtype))
