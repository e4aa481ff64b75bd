"""The paged KV pool on the device: fixed-size blocks, one tensor.

Layout is layer-major, [num_layers, 2 (K, V), num_blocks, block_size, kv_heads, head_dim]: a
layer's K (or V) is one contiguous [num_blocks * block_size] array of token slots, so writing
new tokens is one `index_copy_` and gathering a batch's blocks is one `index_select` whose
result is already laid out as [batch, tokens, heads, dim]. Exporting a request gathers its
blocks of every layer into one contiguous buffer, [num_layers, 2, n, block_size, ...].
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence

import torch

from shared.engine.config import ModelConfig
from shared.engine.parallel.layout import kv_block_bytes, kv_budget_problem

MIB = 1 << 20
MAX_WARM_BYTES = 256 * MIB  # what `Staging.warm` lays ready at most, in all
# room for a tensor of a shape and dtype: torch.empty's, or a staging buffer's (`Staging.take`)
Alloc = Callable[[Sequence[int], torch.dtype], torch.Tensor]


def block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """A block's bytes over the whole of `config` (one rank holding every layer and head)."""
    return kv_block_bytes(config, 1, 1, block_size,
                          torch.empty((), dtype=dtype).element_size())


class KVCache:
    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        assert num_blocks > 0, "a budget is checked first (kv_budget_problem)"
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
        block = block_bytes(config, block_size, dtype)
        problem = kv_budget_problem(budget_bytes, block, block_size, config.name)
        if problem is not None:
            raise ValueError(problem)
        return cls(config, budget_bytes // block, block_size, dtype, device)

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
                      heads: slice = slice(None), alloc: Alloc | None = None) -> torch.Tensor:
        """A request's blocks as one contiguous buffer ([layers, 2, n, block_size, H, D]):
        of every layer and KV head of the pool, or of some; in room `alloc` gives."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        source = self.data[layers, :, :, :, heads]
        if alloc is None:
            return source.index_select(2, index)
        shape = (*source.shape[:2], len(block_ids), *source.shape[3:])
        return torch.index_select(source, 2, index, out=alloc(shape, self.data.dtype))

    def empty_blocks(self, num_blocks: int, alloc: Alloc | None = None) -> torch.Tensor:
        """Room for `num_blocks` exported blocks of this pool's layout (`alloc`'s where
        given)."""
        shape = (*self.data.shape[:2], num_blocks, *self.data.shape[3:])
        if alloc is not None:
            return alloc(shape, self.data.dtype)
        return torch.empty(shape, dtype=self.data.dtype, device=self.data.device)

    def import_blocks(self, block_ids: list[int], buffer: torch.Tensor) -> None:
        """Place exported blocks at (possibly different) block ids of this pool."""
        expected = (*self.data.shape[:2], len(block_ids), *self.data.shape[3:])
        assert tuple(buffer.shape) == expected, (
            f"KV buffer shape {tuple(buffer.shape)} does not match {expected}")
        index = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        self.data.index_copy_(2, index, buffer.to(self.data.device, self.data.dtype))


def _mib_ceil(nbytes: int) -> int:
    """`nbytes` rounded up to a whole MiB, at least one."""
    return -(-max(nbytes, 1) // MIB) * MIB


class Staging:
    """Host buffers KV blocks are staged in on their way out of a pool or into one, kept for
    the next transfer: a fresh buffer pays for its first touch, page by page (the prefill
    side's copy of 512 tokens of SmolLM2's KV, 23.6 MB, out of the pool took 11-17 ms into a
    fresh buffer and 3-5 ms into one the allocator happened to reuse; Zen 4). A buffer is
    lent (`take`) until given back (`give`); one never given back (a transfer abandoned) is
    simply not reused. At most `keep` idle buffers are kept, the largest, of at most
    `max_idle_bytes` together (a larger one is let go); each is rounded up to a MiB. Any
    thread."""

    def __init__(self, keep: int = 2, max_idle_bytes: int = 256 * MIB) -> None:
        self.keep, self.max_idle_bytes = keep, max_idle_bytes
        self._idle: list[torch.Tensor] = []  # uint8, 1-D
        self._lock = threading.Lock()
        self.fresh = 0  # buffers allocated (the rest of the takes reused one)

    @classmethod
    def for_pool(cls, kv: KVCache, warm_tokens: int = 0) -> Staging | None:
        """The staging of transfers out of or into `kv`: on the CPU, with a quarter of its
        bytes idle at most, buffers for the KV of `warm_tokens` tokens laid ready (`warm`);
        None on a GPU (CUDA's caching allocator reuses its own)."""
        if kv.data.device.type != "cpu":
            return None
        staging = cls(max_idle_bytes=kv.data.nbytes // 4)
        if warm_tokens > 0:
            blocks = min(-(-warm_tokens // kv.block_size), kv.num_blocks)
            staging.warm(blocks * (kv.data.nbytes // kv.num_blocks))
        return staging

    def warm(self, nbytes: int) -> int:
        """Lay `keep` idle buffers of `nbytes` each ready, every page touched (smaller where
        `keep` of them would pass `max_idle_bytes`), so that the first transfers find theirs
        paged in: a fresh buffer pays for each page at its first touch, on a VM whose
        balloon takes back freed pages about 12 us a page (a first pull of 41 MB took
        239-277 ms against 20-55 ms for the next ones; Zen 4). At most `MAX_WARM_BYTES` in
        all: a large model's buffers are still taken as pulls need them. The bytes laid
        ready."""
        size = min(_mib_ceil(nbytes), self.max_idle_bytes // self.keep // MIB * MIB,
                   MAX_WARM_BYTES // self.keep // MIB * MIB)
        if size <= 0:
            return 0
        buffers = [torch.zeros(size, dtype=torch.uint8) for _ in range(self.keep)]
        with self._lock:
            self._idle = sorted(self._idle + buffers, key=torch.Tensor.numel)[-self.keep:]
        return size * len(buffers)

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous host tensor of `shape` and `dtype` over a staging buffer: the
        smallest idle one that holds it, else a new one."""
        nbytes = math.prod(shape) * dtype.itemsize
        with self._lock:  # idle buffers are kept smallest first, of one size oldest first
            fits = [i for i, b in enumerate(self._idle) if b.numel() >= nbytes]
            if fits:  # the smallest that holds it, the one given back last of that size
                size = self._idle[fits[0]].numel()
                fits = [i for i in fits if self._idle[i].numel() == size]
            base = self._idle.pop(fits[-1]) if fits else None
            self.fresh += base is None
        if base is None:
            base = torch.empty(_mib_ceil(nbytes), dtype=torch.uint8)
        return base[:nbytes].view(dtype).view(tuple(shape))

    def give(self, lent: torch.Tensor) -> None:
        """Take back a tensor `take` lent (or any view of it), which nothing reads or writes
        any more: its whole buffer is kept for the next `take` (once: given back twice, it
        is still lent once)."""
        storage = lent.untyped_storage()
        if lent.device.type != "cpu" or storage.nbytes() > self.max_idle_bytes:
            return
        with self._lock:
            if any(b.data_ptr() == storage.data_ptr() for b in self._idle):
                return
            self._idle.append(torch.empty(0, dtype=torch.uint8).set_(storage))
            self._idle.sort(key=torch.Tensor.numel)  # stable: of one size, oldest first
            # the smallest beyond `keep` (of one size, the oldest)
            del self._idle[:max(0, len(self._idle) - self.keep)]
            while sum(b.numel() for b in self._idle) > self.max_idle_bytes:
                self._idle.pop()  # the largest

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._idle)
