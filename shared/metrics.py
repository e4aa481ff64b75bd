"""Latency objectives and goodput: one definition for the simulator, the planner and the
benchmark."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise ValueError(f"SLOs must be positive, got TTFT {self.ttft_s}, TPOT {self.tpot_s}")

    def scaled(self, scale: float) -> SLO:
        return SLO(self.ttft_s * scale, self.tpot_s * scale)


def tpot(first_token_s: float, last_token_s: float, output_tokens: int) -> float:
    """Time per output token after the first, as in the paper; 0 for a one-token output."""
    if output_tokens <= 1:
        return 0.0
    return (last_token_s - first_token_s) / (output_tokens - 1)


def attains(ttft_s: float | None, tpot_s: float | None, slo: SLO) -> bool:
    """A request attains only if it completed and met both objectives; a failed or timed-out
    request (None) never does."""
    return ttft_s is not None and tpot_s is not None and ttft_s <= slo.ttft_s and \
        tpot_s <= slo.tpot_s


def attainment(ttfts: Sequence[float | None], tpots: Sequence[float | None], slo: SLO) -> float:
    """Share of all requests (failed ones included) that met both objectives."""
    if not ttfts:
        return 0.0
    met = sum(attains(a, b, slo) for a, b in zip(ttfts, tpots, strict=True))
    return met / len(ttfts)


def goodput_from_curve(rates: Sequence[float], attainments: Sequence[float],
                       target: float = 0.9) -> float:
    """The rate where attainment falls through `target`, interpolated linearly between the
    last measured rate that met it and the next one; 0 if even the lowest rate misses it."""
    pairs = sorted(zip(rates, attainments, strict=True))
    if not pairs or pairs[0][1] < target:
        return 0.0
    for (r0, a0), (r1, a1) in itertools.pairwise(pairs):
        if a1 < target:
            return r0 + (r1 - r0) * (a0 - target) / (a0 - a1)
    return pairs[-1][0]


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
    if not values:
        return {f"p{q:g}": float("nan") for q in qs}
    arr = np.asarray(values, dtype=float)
    return {f"p{q:g}": float(np.percentile(arr, q)) for q in qs}
