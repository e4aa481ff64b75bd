"""Prefix affinity: which instance a prompt's start was last sent to, so that a request
whose prompt starts as an earlier one goes where that one's KV blocks may still be cached
(block_manager.py), among the instances dispatch finds least loaded. Pure: the gateway
records where each request went and asks before it dispatches the next.

A prompt is named by the hash chain of its full blocks (the engine's `chain_hashes`, in the
gateway's block size: a hint of where a prefix went, whatever block size an instance pools
in); the longest of a prompt's leading runs recorded names the instance. Bounded: the
least recently used prefixes are forgotten first. The planner's simulator dispatches by it
too, a block named there by its id in a workload (simulator/prefixes.py)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from shared.engine.block_manager import BlockHash, chain_hashes

BLOCK = 16  # tokens a block of the gateway's reckoning (the workers' default block size)
MOST_PREFIXES = 1 << 16  # blocks remembered (~9 MiB: hashes, names, the LRU's links)


class PrefixAffinity:
    def __init__(self, block_size: int = BLOCK, most: int = MOST_PREFIXES) -> None:
        self.block_size, self.most = block_size, most
        self._sent: OrderedDict[Hashable, str] = OrderedDict()

    def hashes(self, prompt_ids: Sequence[int], salt: str = "") -> list[BlockHash]:
        """The prompt's full blocks' hashes (as a request of `salt` has them cached), but
        the block that holds its last token (an instance computes that one whatever it
        holds)."""
        return chain_hashes(prompt_ids[:len(prompt_ids) - 1], self.block_size, salt=salt)

    def holder(self, hashes: Sequence[Hashable]) -> str:
        """The instance the longest recorded leading run of `hashes` went to ("": none)."""
        for digest in reversed(hashes):
            instance = self._sent.get(digest)
            if instance is not None:
                return instance
        return ""

    def record(self, hashes: Sequence[Hashable], instance: str) -> None:
        """A prompt of these blocks went to `instance`."""
        for digest in hashes:
            self._sent[digest] = instance
            self._sent.move_to_end(digest)
        while len(self._sent) > self.most:
            self._sent.popitem(last=False)
