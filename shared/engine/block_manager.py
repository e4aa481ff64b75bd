"""Bookkeeping of the paged KV pool: which block ids are free. No device memory here.
Each call is atomic, and a run of calls can hold the pool (`held`): the engine's steps take
and free blocks on their thread while a decode service on the CPU takes the blocks for a
pull on its own (`Engine.blocks_off_thread`)."""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Iterator


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()
        self._lock = threading.RLock()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """No other thread takes or frees a block until the body ends (this one may)."""
        with self._lock:
            yield

    def allocate(self, num_blocks: int) -> list[int] | None:
        """`num_blocks` fresh block ids, or None when they cannot fit (nothing is taken)."""
        with self._lock:
            if not self.can_allocate(num_blocks):
                return None
            ids = [self._free.popleft() for _ in range(num_blocks)]
            self._used.update(ids)
            return ids

    def free(self, block_ids: list[int]) -> None:
        with self._lock:
            for block in block_ids:
                assert block in self._used, f"block {block} freed twice or never allocated"
                self._used.remove(block)
                self._free.append(block)

    def grow(self, block_table: list[int], num_tokens: int) -> bool:
        """Extend `block_table` in place to hold `num_tokens`; False (unchanged) if no room."""
        missing = blocks_for(num_tokens, self.block_size) - len(block_table)
        if missing <= 0:
            return True
        new = self.allocate(missing)
        if new is None:
            return False
        block_table.extend(new)
        return True
