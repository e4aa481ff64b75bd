"""Each simulated instance's prefix cache, and dispatch's lean toward the instance a prompt's
start went to (pure). As in the stack: a worker keeps the KV of the prompts it computed in
its pool and finds a later prompt's start there (block_manager.py), and the gateway sends a
prompt to the one an earlier prompt with its start went to (services/gateway/affinity.py)
where that is among the least loaded or has no more prompt tokens to compute first, less
what it may hold (shared.state.leans). So several instances split a workload's prefixes
among their caches, each finding only what its own requests left."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from services.gateway.affinity import BLOCK, MOST_PREFIXES, PrefixAffinity
from services.planner.simulator.core import InstanceSpec, SimRequest
from shared.state import leans
from shared.workloads import CACHE_PAGE, PrefixCache


class PrefixCaches:
    """The caches of instances `specs` (each made at its first request, its size as its
    request's `PrefixCaching` says) and where each prompt's blocks went last. A request
    without `caching` keeps the cached tokens its workload gave it."""

    def __init__(self, specs: Sequence[InstanceSpec]) -> None:
        self.specs = specs
        self.alone = len(specs) == 1  # every request goes to it
        self._caches: dict[int, PrefixCache] = {}
        self._went: PrefixAffinity | None = None

    def holder(self, r: SimRequest) -> tuple[int, dict[int, int]]:
        """The instance the longest start of `r`'s prompt that went anywhere went to last
        (-1: none), and how many of its tokens each instance may hold, as the gateway counts
        them (`PrefixAffinity.found`)."""
        if r.caching is None or self._went is None or self.alone:
            return -1, {}
        went, runs = self._went.found(self._blocks(r))
        pages = (r.prompt - 1) // CACHE_PAGE * CACHE_PAGE
        return int(went) if went else -1, {
            int(i): min(pages, n * r.caching.block_tokens) for i, n in runs.items()}

    def dispatch(self, r: SimRequest, least_of: Callable[[int], int],
                 pending: Callable[[int], int], held: Callable[[int], int] | None = None,
                 full: Callable[[int], bool] | None = None) -> int:
        """The instance `r` goes to, as the gateway's `_pick` sends it: the least loaded
        (`least_of` the holder: by the mode's key, ties to the holder), or the instance its
        prompt's start went to where that has no more to compute first (`pending`: the
        prompt tokens each has not yet taken past their first token; `leans`), and, for a
        colocated instance (`held`: the requests each holds), no more requests than the
        slack allows, and not `full`. `r.reckoned`: the prompt tokens the gateway reckons
        it computes there."""
        holder, saved = self.holder(r)
        least = least_of(holder)
        lean = False
        if 0 <= holder != least and saved and not (full is not None and full(holder)):
            over = 0 if held is None else held(holder) - held(least)
            lean = leans((pending(least), saved.get(least, 0)),
                         (pending(holder), saved.get(holder, 0)), over)
        instance = holder if lean else least
        r.reckoned = r.prompt - saved.get(instance, 0)
        return instance

    def take(self, r: SimRequest, instance: int) -> None:
        """`r` goes to `instance`: of its prompt, the tokens that instance's cache holds are
        cached (whole pages, never its last token's), and its prompt is kept there."""
        caching = r.caching
        if caching is None or (self.alone and caching.counted == caching.size(
                self.specs[instance].kv_capacity)):
            return  # (one instance of the size its workload counted with finds as counted)
        cache = self._caches.get(instance)
        if cache is None:
            cache = self._caches[instance] = caching.cache(self.specs[instance].kv_capacity)
        found = cache.take(r.prefix, r.prompt)  # (as `cached_tokens` counts them)
        r.cached = max(0, min(found, r.prompt - 1)) // CACHE_PAGE * CACHE_PAGE
        if self.alone:
            return
        if self._went is None:  # as many tokens as the gateway remembers
            self._went = PrefixAffinity(
                most=max(1, MOST_PREFIXES * BLOCK // caching.block_tokens))
        self._went.record(self._blocks(r), str(instance))

    @staticmethod
    def _blocks(r: SimRequest) -> Sequence[int]:
        """The blocks the gateway names `r`'s prompt by: those of its whole pages but the
        one of its last token."""
        assert r.caching is not None
        pages = (r.prompt - 1) // CACHE_PAGE * CACHE_PAGE
        return r.prefix[:-(-pages // r.caching.block_tokens)]
