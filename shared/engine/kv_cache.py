"""The paged KV pool on the device: fixed-size blocks, one tensor.

Layout is layer-major, [num_layers, 2 (K, V), num_blocks, block_size, kv_heads, head_dim]: a
layer's K (or V) is one contiguous [num_blocks * block_size] array of token slots, so writing
new tokens is one `index_copy_` and gathering a batch's blocks is one `index_select` whose
result is already laid out as [batch, tokens, heads, dim]. Exporting a request gathers its
blocks of every layer into one contiguous buffer, [num_layers, 2, n, block_size, ...].
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
        shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads,
                 config.head_dim)
        self.data = torch.zeros(shape, dtype=dtype, device=device)
        # [layer][K or V] -> [num_blocks * block_size, kv_heads, head_dim] views of `data`
        self.slots = [(layer[0].flatten(0, 1), layer[1].flatten(0, 1)) for layer in self.data]

    @classmethod
    def from_budget(
        cls, config: ModelConfig, budget_bytes: int, block_size: int,
        dtype: torch.dtype, device: torch.device,
    ) -> KVCache:
        return cls(config, budget_bytes // block_bytes(config, block_size, dtype), block_size,
                   dtype, device)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store K/V of new tokens ([T, kv_heads, head_dim]) at token slots
        (block * block_size + offset), in the pool's dtype."""
        keys, values = self.slots[layer]
        keys.index_copy_(0, slots, k.to(keys.dtype))
        values.index_copy_(0, slots, v.to(values.dtype))

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole block tables ([B, max_blocks]) as [B, max_blocks*block_size, H, D]."""
        b, n = block_tables.shape
        flat = block_tables.reshape(-1)
        keys = self.data[layer, 0].index_select(0, flat)
        values = self.data[layer, 1].index_select(0, flat)
        return keys.view(b, n * self.block_size, *keys.shape[2:]), \
            values.view(b, n * self.block_size, *values.shape[2:])

    def export_blocks(self, block_ids: list[int], layers: slice = slice(None),
                      heads: slice = slice(None)) -> torch.Tensor:
        """A request's blocks as one contiguous buffer ([layers, 2, n, block_size, H, D]):
        of every layer and KV head of the pool, or of some."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        return self.data[layers, :, :, :, heads].index_select(2, index)

    def empty_blocks(self, num_blocks: int) -> torch.Tensor:
        """Room for `num_blocks` exported blocks of this pool's layout."""
        shape = (*self.data.shape[:2], num_blocks, *self.data.shape[3:])
        return torch.empty(shape, dtype=self.data.dtype, device=self.data.device)

    def import_blocks(self, block_ids: list[int], buffer: torch.Tensor) -> None:
        """Place exported blocks at (possibly different) block ids of this pool."""
        expected = (*self.data.shape[:2], len(block_ids), *self.data.shape[3:])
        assert tuple(buffer.shape) == expected, (
            f"KV buffer shape {tuple(buffer.shape)} does not match {expected}")
        index = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        self.data.index_copy_(2, index, buffer.to(self.data.device, self.data.dtype))
