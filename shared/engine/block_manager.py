"""Bookkeeping of the paged KV pool: which block ids are free, and which hold a prefix another
request may reuse. No device memory here. Each call is atomic, and a run of calls can hold
the pool (`held`): the engine's steps take and free blocks on their thread while a decode
service on the CPU takes the blocks for a pull on its own (`Engine.blocks_off_thread`).

Prefix caching: a full block's K/V depend only on the tokens up to its end, so a block is
named by a hash of those tokens (`chain_hashes`: each block's from the one before and its
own). A block computed for one request is registered under its hash; a later request whose
tokens start the same takes the registered blocks (a reference each: a block is shared by
every request that holds it, and written by none, as each writes past its shared prefix
only) and computes only the rest. A block nobody holds keeps its hash and its K/V and counts
as free: it is reused as long as the pool does not need it, and taken, least recently freed
first, when it does (`allocate`)."""

from __future__ import annotations

import contextlib
import hashlib
import struct
import threading
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence

BlockHash = bytes


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def chain_hashes(tokens: Sequence[int], block_size: int, before: Sequence[BlockHash] = (),
                 salt: str = "") -> list[BlockHash]:
    """The hashes of `tokens`' full blocks, `before` (those of its first blocks) extended:
    each a digest of the previous block's hash (the first block's: of `salt`) and the
    block's own tokens. A cryptographic hash, as a prompt crafted to collide with another's
    prefix would be answered from that prefix's K/V; prompts of different salts share no
    block (tenants kept apart, as vLLM's `cache_salt`)."""
    hashes = list(before)
    first = b"\x01" + salt.encode()  # apart from any block's hash (b"\x00" + 16 bytes)
    for i in range(len(hashes), len(tokens) // block_size):
        digest = hashlib.blake2b(b"\x00" + hashes[-1] if hashes else first, digest_size=16)
        digest.update(struct.pack(f"<{block_size}I", *tokens[i * block_size:(i + 1) * block_size]))
        hashes.append(digest.digest())
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))  # holding nothing to reuse
        self._refs: dict[int, int] = {}  # held blocks: how many requests hold each
        # free blocks still holding a registered prefix, least recently freed first
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._by_hash: dict[BlockHash, int] = {}  # registered blocks, held or free
        self._hash_of: dict[int, BlockHash] = {}
        self._lock = threading.RLock()

    @property
    def num_free(self) -> int:
        """Blocks no request holds, those holding a cached prefix included."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Free blocks that still hold a prefix a request may reuse."""
        return len(self._cached)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """No other thread takes or frees a block until the body ends (this one may)."""
        with self._lock:
            yield

    def allocate(self, num_blocks: int) -> list[int] | None:
        """`num_blocks` fresh block ids, or None when they cannot fit (nothing is taken):
        blocks holding nothing first, then cached ones, least recently freed first (their
        prefix forgotten)."""
        with self._lock:
            if not self.can_allocate(num_blocks):
                return None
            ids = []
            for _ in range(num_blocks):
                if self._free:
                    block = self._free.popleft()
                else:
                    block, _ = self._cached.popitem(last=False)
                    del self._by_hash[self._hash_of.pop(block)]
                self._refs[block] = 1
                ids.append(block)
            return ids

    def free(self, block_ids: list[int]) -> None:
        """Give back a reference to each block. A block table is given back from its end, so
        that of a freed prefix its last blocks are taken first (its first are the likelier
        to be shared)."""
        with self._lock:
            for block in reversed(block_ids):
                refs = self._refs.get(block)
                assert refs is not None, f"block {block} freed twice or never allocated"
                if refs > 1:
                    self._refs[block] = refs - 1
                    continue
                del self._refs[block]
                if block in self._hash_of:
                    self._cached[block] = None
                else:
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

    # -- prefix caching -------------------------------------------------------------------

    def cached_run(self, hashes: Sequence[BlockHash]) -> tuple[int, int]:
        """How many of `hashes`, from the first, name registered blocks, and how many of
        those are free (taking them makes the pool that much smaller)."""
        with self._lock:
            run = free = 0
            for digest in hashes:
                block = self._by_hash.get(digest)
                if block is None:
                    break
                run += 1
                free += block in self._cached
            return run, free

    def allocate_after(self, hashes: Sequence[BlockHash], num_blocks: int
                       ) -> tuple[list[int], int] | None:
        """`num_blocks` blocks for a table whose leading ones are the registered blocks of
        `hashes`' leading run (a reference taken to each) and the rest fresh, and how many
        were found; None when they cannot fit (nothing is taken)."""
        with self._lock:
            run, revived = self.cached_run(hashes[:num_blocks])
            if not self.can_allocate(num_blocks - run + revived):
                return None
            found = self.take_cached(hashes[:run])
            fresh = self.allocate(num_blocks - run)
            assert fresh is not None and len(found) == run
            return found + fresh, run

    def take_cached(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The registered blocks of `hashes`' leading run, a reference taken to each."""
        with self._lock:
            blocks = []
            for digest in hashes:
                block = self._by_hash.get(digest)
                if block is None:
                    break
                if block in self._cached:
                    del self._cached[block]
                    self._refs[block] = 1
                else:
                    self._refs[block] += 1
                blocks.append(block)
            return blocks

    def register(self, block: int, digest: BlockHash) -> None:
        """`block` (held) now holds the K/V of the prefix `digest` names. A prefix another
        block holds already stays that one's: this block is freed as any other."""
        with self._lock:
            assert block in self._refs, f"block {block} registered but not held"
            if digest not in self._by_hash and block not in self._hash_of:
                self._by_hash[digest] = block
                self._hash_of[block] = digest
