"""Goodput: the highest rate whose simulated attainment meets the target, by bisection."""

from __future__ import annotations

from collections.abc import Callable

# below 1 / FLOOR_CHECK of the first rate tried, nothing attained yet, the lowest rate is tried
# before halving on
FLOOR_CHECK = 16


def max_rate(attainment_at: Callable[[float], float], target: float, guess: float,
             upper: float = float("inf"), rel_tol: float = 0.02,
             max_doublings: int = 20) -> float:
    """Largest rate r <= `upper` with attainment_at(r) >= target (0 if even tiny rates miss
    it). `upper` is what the system can sustain at all (its throughput bound): a finite
    simulated burst above it could still be absorbed and look attained. Assumes attainment
    falls as the rate grows, as it does for common-random-number workloads."""
    assert guess > 0
    lo, hi = 0.0, min(guess, upper)
    start = hi
    for _ in range(max_doublings):
        if attainment_at(hi) < target:
            break
        if hi >= upper:
            return upper
        lo, hi = hi, min(hi * 2, upper)
    else:
        return lo
    floor = guess / 2**max_doublings
    while hi - lo > rel_tol * hi and hi > floor:
        if lo == 0 and hi < start / FLOOR_CHECK:
            # missed well below the first rate: a config that misses at any rate (the SLO is
            # beneath its lone request's latency) would take 20 more halvings to say so, each
            # a simulation of requests decoding one by one, the slowest kind to simulate
            if attainment_at(floor) < target:
                return 0.0
            lo = floor
        mid = (lo + hi) / 2
        if attainment_at(mid) >= target:
            lo = mid
        else:
            hi = mid
    return lo
