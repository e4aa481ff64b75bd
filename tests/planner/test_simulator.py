"""The simulator against queueing theory (the paper's Eqs. 1-3) and its bookkeeping."""

from __future__ import annotations

import pytest

from services.planner.latency import LatencyModel, PhaseCoefficients
from services.planner.simulator import (
    ColocatedCluster,
    DisaggregatedCluster,
    InstanceSpec,
    Link,
    simulate_colocated,
    simulate_decode_only,
    simulate_disaggregated,
)
from shared.workloads import Workload, fixed_lengths

PROMPT = 512
COEFFS = PhaseCoefficients((10.0, 0.1, 0.0), (10.0, 0.001, 0.05), (10.0, 0.001, 0.05))
D = (10.0 + 0.1 * PROMPT) / 1e3  # seconds to prefill one prompt on one device


def mean_ttft(latency: LatencyModel, rate: float, n: int = 40000) -> float:
    spec = InstanceSpec(latency, kv_capacity=10**7, max_batch_tokens=PROMPT)  # no batching
    requests = Workload(fixed_lengths(PROMPT, 1)).requests(rate, n, seed=3)
    result = simulate_disaggregated(DisaggregatedCluster([spec], [], Link(1)), requests)
    ttfts = [r.ttft for r in result.requests]
    assert all(t is not None for t in ttfts)
    return sum(t for t in ttfts if t is not None) / n


@pytest.mark.parametrize("utilisation", [0.3, 0.6, 0.8])
def test_single_prefill_instance_is_md1(utilisation: float) -> None:
    rate = utilisation / D
    theory = D + rate * D * D / (2 * (1 - rate * D))  # Eq. 1
    assert mean_ttft(LatencyModel(COEFFS), rate) == pytest.approx(theory, rel=0.05)


@pytest.mark.parametrize("utilisation", [0.3, 0.6, 0.8])
def test_two_way_inter_op_follows_eq2(utilisation: float) -> None:
    rate = utilisation / D
    theory = D + rate * D * D / (4 * (2 - rate * D))  # Eq. 2
    assert mean_ttft(LatencyModel(COEFFS, pp=2), rate) == pytest.approx(theory, rel=0.10)


@pytest.mark.parametrize("k", [1.3, 1.7])
@pytest.mark.parametrize("utilisation", [0.3, 0.6, 0.8])
def test_two_way_intra_op_follows_eq3(utilisation: float, k: float) -> None:
    rate = utilisation / D
    theory = D / k + rate * D * D / (2 * k * (k - rate * D))  # Eq. 3
    assert mean_ttft(LatencyModel(COEFFS.scaled(k)), rate) == pytest.approx(theory, rel=0.10)


def spec(capacity: int = 10**6, batch: int = 256) -> InstanceSpec:
    return InstanceSpec(LatencyModel(COEFFS), capacity, max_batch_tokens=1024, max_batch=batch)


def test_disaggregated_every_request_completes_and_phases_add_up() -> None:
    requests = Workload(fixed_lengths(300, 40)).requests(20.0, 400, seed=1)
    cluster = DisaggregatedCluster([spec(), spec()], [spec()], Link(1, 1e5, 1e5))
    result = simulate_disaggregated(cluster, requests)
    assert all(r.done for r in result.requests)
    for r in result.requests:
        phases = [r.prefill_start - r.arrival, r.first_token - r.prefill_start,
                  r.transfer_start - r.first_token, r.transfer_end - r.transfer_start,
                  r.decode_start - r.transfer_end, r.finish - r.decode_start]
        assert all(p >= -1e-12 for p in phases)
        assert sum(phases) == pytest.approx(r.finish - r.arrival)
        assert r.transfer_end - r.transfer_start == pytest.approx(300 / 1e5)  # 1 B/token
    breakdown = result.breakdown()
    assert set(breakdown) == {"prefill_queue", "prefill_run", "transfer", "decode_queue",
                              "decode_run"}


def test_small_decode_pool_queues_requests_but_loses_none() -> None:
    requests = Workload(fixed_lengths(100, 50)).requests(50.0, 300, seed=2)
    roomy = simulate_decode_only(spec(), requests)
    tight = simulate_decode_only(spec(capacity=3 * 150), requests)  # three requests at once
    assert all(r.done for r in tight.requests)
    mean = sum(r.tpot or 0 for r in tight.requests) / 300
    assert mean > sum(r.tpot or 0 for r in roomy.requests) / 300


@pytest.mark.parametrize("chunked", [False, True])
def test_colocated_completes_and_interference_raises_tpot(chunked: bool) -> None:
    requests = Workload(fixed_lengths(512, 64)).requests(10.0, 300, seed=4)
    result = simulate_colocated(ColocatedCluster([spec()], chunked), requests)
    assert all(r.done for r in result.requests)
    alone = simulate_decode_only(spec(), requests)
    mean = sum(r.tpot or 0 for r in result.requests) / 300
    assert mean > sum(r.tpot or 0 for r in alone.requests) / 300  # prefills stall decodes
