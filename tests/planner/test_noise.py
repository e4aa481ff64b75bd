"""Step noise (services/planner/noise.py): fitted from a stack's step ratios, drawn by the
simulator as they scattered, in the order they came."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import statistics

import pytest

from services.planner.latency import LatencyModel, PhaseCoefficients
from services.planner.noise import Jitter, Noise, StepNoise, fit_noise, jitters
from services.planner.simulator import (
    ColocatedCluster,
    DisaggregatedCluster,
    InstanceSpec,
    Link,
    simulate_colocated,
    simulate_disaggregated,
)
from shared.workloads import Workload, fixed_lengths

NORMAL = statistics.NormalDist()


def ar1_ratios(n: int, phi: float, seed: int) -> list[float]:
    """Lognormal ratios (median 1, sigma 0.1) whose logs follow an AR(1) of lag-1 `phi`."""
    rng, x, out = random.Random(seed), 0.0, []
    for _ in range(n):
        x = phi * x + math.sqrt(1 - phi * phi) * rng.gauss(0.0, 1.0)
        out.append(math.exp(0.1 * x))
    return out


def normal_lag1(draws: list[float]) -> float:
    """The lag-1 autocorrelation of the draws' normal scores (by rank)."""
    order = sorted(range(len(draws)), key=draws.__getitem__)
    scores = [0.0] * len(draws)
    for rank, i in enumerate(order):
        scores[i] = NORMAL.inv_cdf((rank + 0.5) / len(draws))
    return sum(a * b for a, b in itertools.pairwise(scores)) / sum(
        z * z for z in scores)


@pytest.mark.parametrize("phi", [0.0, 0.5, 0.8])
def test_the_fit_keeps_the_spread_and_the_spells(phi: float) -> None:
    """Ratios of two instances whose logs follow an AR(1) of lag-1 `phi`: the fitted
    quantiles are the ratios' own, and the lag-1 of their normal scores is `phi`."""
    runs = [ar1_ratios(3000, phi, seed) for seed in (1, 2)]
    noise = fit_noise(runs)
    assert noise is not None
    pooled = sorted(runs[0] + runs[1])
    assert noise.ratios[0] == pooled[0] and noise.ratios[-1] == pooled[-1]
    assert noise.ratio_at(0.5) == pytest.approx(statistics.median(pooled), rel=1e-3)
    assert noise.ratio_at(0.9) == pytest.approx(math.exp(0.1 * NORMAL.inv_cdf(0.9)), rel=0.02)
    assert noise.mean == pytest.approx(statistics.fmean(pooled), rel=2e-3)
    assert noise.lag1 == pytest.approx(phi, abs=0.05)


def test_too_few_steps_or_a_negative_follow_say_no_noise_or_none() -> None:
    assert fit_noise([[1.0] * 10, [1.1] * 9]) is None  # 19 of the 20 needed
    alternating = [1.0 + 0.1 * (i % 2) for i in range(100)]  # lag-1 near -1: not spells
    found = fit_noise([alternating])
    assert found is not None and found.lag1 == 0.0
    with pytest.raises(AssertionError):
        StepNoise((1.2, 1.0))  # not quantiles, lowest first


@pytest.mark.parametrize("phi", [0.0, 0.7])
def test_draws_scatter_as_the_table_says_and_follow_each_other(phi: float) -> None:
    """A Jitter's factors are distributed as the quantiles it draws through (mean, median,
    deciles) and their normal scores follow each other by `lag1`; `peek` draws nothing; the
    same seed draws the same factors."""
    noise = StepNoise((0.8, 0.9, 1.0, 1.3, 2.0), phi)
    jitter = Jitter(noise, random.Random(4))
    assert jitter.peek() == jitter.peek()
    draws = []
    for _ in range(20000):
        ahead = jitter.peek()
        draws.append(jitter.take())
        assert draws[-1] == ahead
    assert statistics.fmean(draws) == pytest.approx(noise.mean, rel=0.02)
    assert statistics.median(draws) == pytest.approx(1.0, rel=0.02)
    assert min(draws) >= 0.8 and max(draws) <= 2.0
    assert statistics.quantiles(draws, n=4)[2] == pytest.approx(noise.ratio_at(0.75), rel=0.02)
    assert normal_lag1(draws) == pytest.approx(phi, abs=0.04)
    again = Jitter(noise, random.Random(4))
    assert [again.take() for _ in range(100)] == draws[:100]


def test_each_instance_and_phase_draws_its_own_stream() -> None:
    noise = Noise(StepNoise((0.5, 1.0, 1.5)), StepNoise((0.5, 1.0, 1.5)), seed=3)
    first, second = jitters(noise, 0), jitters(noise, 1)
    assert first is not None and second is not None
    take = [[j.take() for _ in range(20)] for j in (first["prefill"], first["decode"],
                                                    second["prefill"])]
    assert take[0] != take[1] and take[0] != take[2]
    again = jitters(noise, 0)
    assert again is not None and [again["prefill"].take() for _ in range(20)] == take[0]
    assert jitters(Noise(), 0) is None
    assert set(jitters(Noise(decode=StepNoise((1.0, 2.0))), 0) or {}) == {"decode"}


COEFFS = PhaseCoefficients((10.0, 1.0, 0.0), (10.0, 0.001, 0.05), (10.0, 0.001, 0.05))


def finishes(spec: InstanceSpec, mode: str, rate: float) -> list[float]:
    requests = Workload(fixed_lengths(200, 40)).requests(rate, 60, seed=2)
    if mode == "disaggregated":
        result = simulate_disaggregated(DisaggregatedCluster([spec], [spec], Link(1, 1e12)),
                                        requests)
    else:
        result = simulate_colocated(ColocatedCluster([spec] * 2, mode == "chunked"),
                                    requests)
    return [r.finish for r in result.requests]


@pytest.mark.parametrize("mode", ["disaggregated", "colocated", "chunked"])
def test_every_step_takes_its_draw(mode: str) -> None:
    """Noise whose every ratio is 1.25 runs every step of every instance 1.25x its model's
    time (decode steps skipped at once included): the very simulation of a model 1.25x
    slower; a table of 1.0 changes nothing, to the bit."""
    plain = InstanceSpec(LatencyModel(COEFFS), 10**6, 512)
    slower = dataclasses.replace(plain, latency=LatencyModel(COEFFS.scaled(1 / 1.25)))

    def noisy(ratio: float) -> InstanceSpec:
        return dataclasses.replace(plain, noise=Noise(StepNoise((ratio, ratio), 0.5),
                                                      StepNoise((ratio, ratio), 0.5)))

    for rate in (0.5, 8.0):
        assert finishes(noisy(1.25), mode, rate) == pytest.approx(
            finishes(slower, mode, rate), rel=1e-9)
        assert finishes(noisy(1.0), mode, rate) == finishes(plain, mode, rate)


def test_spells_near_capacity_spread_a_runs_outcome() -> None:
    """One prefill instance at 95% of its capacity, 400 requests a run: with its steps
    scattered (a spread of 8%), the mean TTFT of a run varies from one draw to the next, 3x
    as much where slow steps come in spells (lag-1 0.8) as where they come apart (0); a
    queue built in a slow spell outlasts it. On average, scattered steps wait longer than
    steps at their fitted time."""
    spec = InstanceSpec(LatencyModel(COEFFS), 10**6, 200)  # 210 ms a prompt, alone
    requests = Workload(fixed_lengths(200, 1)).requests(0.95 / 0.21, 400, seed=5)
    table = tuple(math.exp(0.08 * NORMAL.inv_cdf(p)) for p in (0.01, 0.25, 0.5, 0.75, 0.99))

    def mean_ttfts(lag1: float | None) -> list[float]:
        out = []
        for seed in range(20):
            noise = Noise() if lag1 is None else Noise(StepNoise(table, lag1), seed=seed)
            result = simulate_disaggregated(DisaggregatedCluster(
                [dataclasses.replace(spec, noise=noise)], [], Link(1)), requests)
            out.append(statistics.fmean(r.ttft for r in result.requests if r.ttft is not None))
        return out

    fitted, apart, spells = mean_ttfts(None), mean_ttfts(0.0), mean_ttfts(0.8)
    assert statistics.pstdev(fitted) == 0.0
    assert statistics.pstdev(spells) > 2 * statistics.pstdev(apart) > 0
    assert fitted[0] < statistics.fmean(apart) < statistics.fmean(spells)


def test_instances_steadily_above_and_below_the_fit_are_levels_not_spells() -> None:
    """Two instances whose ratios are independent draws, one 4% above the fit and one 4%
    below: their lag-1 is that of independent steps, not of spells."""
    rng = random.Random(9)
    runs = [[level * math.exp(rng.gauss(0.0, 0.05)) for _ in range(500)]
            for level in (1.04, 0.96)]
    noise = fit_noise(runs)
    assert noise is not None and noise.lag1 < 0.1


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_each_simulated_instance_draws_its_own_steps(mode: str) -> None:
    """Two like instances given a prompt each at once: their steps draw from their own
    streams, so the prompts finish at different times (one stream would time them alike)."""
    spec = InstanceSpec(LatencyModel(COEFFS), 10**6, 512, noise=Noise(
        StepNoise((0.5, 1.0, 1.5)), StepNoise((0.5, 1.0, 1.5)), seed=1))
    requests = Workload(fixed_lengths(200, 1)).requests(1.0, 2, seed=0)
    requests = [dataclasses.replace(r, arrival_s=0.0) for r in requests]
    if mode == "disaggregated":
        result = simulate_disaggregated(DisaggregatedCluster([spec, spec], [], Link(1)),
                                        requests)
    else:
        result = simulate_colocated(ColocatedCluster([spec, spec]), requests)
    first, second = (r.first_token for r in result.requests)
    assert first != second
