"""How a host's step times scatter around what the latency model says, and how the simulator
draws them (pure). A fitted model prices every step of a shape alike; the steps a stack runs
do not: on the 2-vCPU hosts here a 512-token prefill took 1.33-2.00 s where its fit said
1.48, and slow steps came in spells (lag-1 autocorrelation 0.5-0.75 a run). Far from an
instance's capacity that changes nothing; near it, the spread and the spells build queues
that a run of median steps never does (docs/benchmarks.md, "64 requests a rate").

Each phase's noise is the measured/predicted ratios of the steps a stack ran: their
quantiles (the spread, with its tail) and the lag-1 autocorrelation of their normal scores
(the spells). The simulator draws an instance's step factors from a Gaussian AR(1) process
mapped through those quantiles (a Gaussian copula): each factor is distributed as the
measured ratios were, and follows the one before as they did."""

from __future__ import annotations

import bisect
import itertools
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from services.planner.latency import PHASES, Phase

QUANTILES = 41  # of a phase's ratios kept: every 2.5%
MOST_LAG1 = 0.95  # a process that follows itself closer than this is a level, not noise
NORMAL = statistics.NormalDist()


@dataclass(frozen=True)
class StepNoise:
    """One phase's steps against their fitted time: `ratios`, the measured/predicted ratio's
    quantiles at evenly spaced probabilities from 0 to 1, and `lag1`, how much a step's
    ratio follows the one its instance ran before (of their normal scores; 0: not at all)."""

    ratios: tuple[float, ...]
    lag1: float = 0.0

    def __post_init__(self) -> None:
        assert len(self.ratios) >= 2 and list(self.ratios) == sorted(self.ratios), \
            "quantiles, lowest first"
        assert all(r > 0 for r in self.ratios) and 0.0 <= self.lag1 <= MOST_LAG1

    def ratio_at(self, p: float) -> float:
        """The ratio at probability `p` (linear between the quantiles kept)."""
        at = p * (len(self.ratios) - 1)
        i = min(int(at), len(self.ratios) - 2)
        return self.ratios[i] + (at - i) * (self.ratios[i + 1] - self.ratios[i])

    @property
    def mean(self) -> float:
        """The mean ratio (trapezoids over the quantiles)."""
        r = self.ratios
        return sum(a + b for a, b in itertools.pairwise(r)) / (2 * (len(r) - 1))

    def describe(self) -> str:
        """'x0.97-1.06 (p10-p90), mean 1.01, lag-1 0.51'."""
        return (f"x{self.ratio_at(0.1):.2f}-{self.ratio_at(0.9):.2f} (p10-p90), "
                f"mean {self.mean:.2f}, lag-1 {self.lag1:.2f}")


@dataclass(frozen=True)
class Noise:
    """Each phase's step noise (None: its steps take their fitted time), and the seed the
    simulator's draws start from."""

    prefill: StepNoise | None = None
    decode: StepNoise | None = None
    seed: int = 0

    @property
    def none(self) -> bool:
        return self.prefill is None and self.decode is None

    def of(self, phase: Phase) -> StepNoise | None:
        return self.prefill if phase == "prefill" else self.decode


def fit_noise(runs: Sequence[Sequence[float]], min_steps: int = 20) -> StepNoise | None:
    """One phase's noise from `runs`: each instance's measured/predicted ratios, in the order
    its steps ran; None under `min_steps` ratios in all. The lag-1 is of each run's normal
    scores about the run's own mean, pooled over the runs."""
    ratios = sorted(r for run in runs for r in run)
    if len(ratios) < min_steps or ratios[0] <= 0:
        return None
    n = len(ratios)
    quantiles = tuple(statistics.quantiles(ratios, n=QUANTILES - 1, method="inclusive"))
    table = (ratios[0], *quantiles, ratios[-1])

    def score(r: float) -> float:  # the normal score of a ratio's mid-rank
        low, high = bisect.bisect_left(ratios, r), bisect.bisect_right(ratios, r)
        return NORMAL.inv_cdf((low + high) / 2 / n)

    # each run's scores about its own mean: an instance steadily above the fit and another
    # below are levels, not spells (pooled raw, every pair of either would read as one)
    scores = []
    for run in runs:
        zs = [score(r) for r in run]
        level = statistics.fmean(zs) if zs else 0.0
        scores.append([z - level for z in zs])
    spread = sum(z * z for run in scores for z in run)
    follows = sum(a * b for run in scores for a, b in itertools.pairwise(run))
    lag1 = follows / spread if spread > 0 else 0.0
    return StepNoise(tuple(sorted(table)), min(MOST_LAG1, max(0.0, lag1)))


class Jitter:
    """One instance's draws of one phase's step factors, in the order its steps run: a
    standard normal AR(1) process (lag-1 `noise.lag1`) through `noise`'s quantiles."""

    def __init__(self, noise: StepNoise, rng: random.Random) -> None:
        self._noise, self._rng = noise, rng
        self._phi, self._rest = noise.lag1, math.sqrt(1.0 - noise.lag1 ** 2)
        self._x = rng.gauss(0.0, 1.0)
        self._next = self._factor()

    def _factor(self) -> float:
        return self._noise.ratio_at(NORMAL.cdf(self._x))

    def peek(self) -> float:
        """The next step's factor, not drawn yet (a step the simulator may not run)."""
        return self._next

    def take(self) -> float:
        """The next step's factor, drawn."""
        factor = self._next
        self._x = self._phi * self._x + self._rest * self._rng.gauss(0.0, 1.0)
        self._next = self._factor()
        return factor


Jitters = dict[Phase, Jitter]


def jitters(noise: Noise, instance: int) -> Jitters | None:
    """The draws of the `instance`-th instance of a simulation (its phases' own streams,
    the same for the same seed and instance); None where `noise` has none."""
    if noise.none:
        return None
    out: Jitters = {}
    for k, phase in enumerate(PHASES):
        found = noise.of(phase)
        if found is not None:
            out[phase] = Jitter(found, random.Random(f"{noise.seed}/{instance}/{k}"))
    return out
