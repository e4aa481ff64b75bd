"""Prefix affinity: which instances a prompt's start was sent to, so that a request whose
prompt starts as an earlier one goes where that one's KV blocks may still be cached
(block_manager.py), where the load allows (the gateway's `_pick`). Pure: the gateway
records where each request went and asks before it dispatches the next.

A prompt is named by the hash chain of its full blocks (the engine's `chain_hashes`, in the
gateway's block size: a hint of where a prefix went, whatever block size an instance pools
in); the longest of a prompt's leading runs recorded names the instance it went to last
(the holder), and each instance's longest run what it may hold. Bounded: the least recently
used prefixes are forgotten first, and a block remembers its last few instances. The
planner's simulator dispatches by it too, a block named there by its id in a workload
(simulator/prefixes.py)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from shared.engine.block_manager import BlockHash, chain_hashes

BLOCK = 16  # tokens a block of the gateway's reckoning (the workers' default block size)
MOST_PREFIXES = 1 << 16  # blocks remembered (~12 MiB: hashes, instances, the LRU's links)
HOLDERS = 4  # instances remembered a block (the most recent)


class PrefixAffinity:
    def __init__(self, block_size: int = BLOCK, most: int = MOST_PREFIXES) -> None:
        self.block_size, self.most = block_size, most
        # block -> the instances it went to, the most recent last (at most HOLDERS)
        self._sent: OrderedDict[Hashable, tuple[str, ...]] = OrderedDict()

    def hashes(self, prompt_ids: Sequence[int], salt: str = "") -> list[BlockHash]:
        """The prompt's full blocks' hashes (as a request of `salt` has them cached), but
        the block that holds its last token (an instance computes that one whatever it
        holds)."""
        return chain_hashes(prompt_ids[:len(prompt_ids) - 1], self.block_size, salt=salt)

    def holder(self, hashes: Sequence[Hashable]) -> str:
        """The instance the longest recorded leading run of `hashes` went to last ("":
        none)."""
        for digest in reversed(hashes):
            went = self._sent.get(digest)
            if went:
                return went[-1]
        return ""

    def found(self, hashes: Sequence[Hashable]) -> tuple[str, dict[str, int]]:
        """The holder (as `holder`), and how many of the prompt's blocks each instance may
        hold: its longest recorded leading run of `hashes` (a run is recorded whole, so the
        blocks before a run's last went there too), of the instances its blocks remember."""
        holder, runs = "", dict[str, int]()
        for n in range(len(hashes), 0, -1):
            went = self._sent.get(hashes[n - 1], ())
            holder = holder or (went[-1] if went else "")
            for instance in went:
                runs.setdefault(instance, n)
        return holder, runs

    def record(self, hashes: Sequence[Hashable], instance: str) -> None:
        """A prompt of these blocks went to `instance`."""
        for digest in hashes:
            went = self._sent.get(digest, ())
            self._sent[digest] = (*(i for i in went if i != instance), instance)[-HOLDERS:]
            self._sent.move_to_end(digest)
        while len(self._sent) > self.most:
            self._sent.popitem(last=False)
