"""The simulator against queueing theory (the paper's Eqs. 1-3) and its bookkeeping."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from services.planner.latency import Contention, LatencyModel, PhaseCoefficients
from services.planner.noise import Noise, StepNoise
from services.planner.placement import instance_spec
from services.planner.profiles import load_profile, shipped_cpu_profile
from services.planner.simulator import (
    ColocatedCluster,
    DisaggregatedCluster,
    InstanceSpec,
    Link,
    SimResult,
    colocated,
    disaggregated,
    simulate_colocated,
    simulate_decode_only,
    simulate_disaggregated,
)
from services.planner.simulator.core import run_quiet_steps
from shared.workloads import Lengths, Workload, WorkloadRequest, fixed_lengths

PROMPT = 512
COEFFS = PhaseCoefficients((10.0, 0.1, 0.0), (10.0, 0.001, 0.05), (10.0, 0.001, 0.05))
D = (10.0 + 0.1 * PROMPT) / 1e3  # seconds to prefill one prompt on one device
NO_CONTENTION = Contention()


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


def test_a_step_slows_by_what_the_other_devices_of_its_host_run() -> None:
    beside = Contention(decode_by_decode=1.4, decode_by_prefill=1.1, prefill_by_decode=1.05)
    assert beside.factor("decode", []) == 1.0
    assert beside.factor("decode", ["decode"]) == pytest.approx(1.4)
    assert beside.factor("decode", ["decode", "prefill"]) == pytest.approx(1.5)  # adds up
    assert beside.factor("prefill", ["prefill"]) == 1.0
    assert Contention().none and not beside.none


def contended(node: int, contention: Contention,
              coefficients: PhaseCoefficients = COEFFS) -> InstanceSpec:
    return InstanceSpec(LatencyModel(coefficients, contention=contention), 10**6,
                        max_batch_tokens=1024, node=node)


@pytest.mark.parametrize("chunked", [False, True])
def test_colocated_replicas_on_one_host_slow_each_others_decode_steps(chunked: bool) -> None:
    """Two requests at once, one on each replica: decoding side by side on one host, each
    step takes the profile's decode_by_decode times as long; on two hosts, as long as alone."""
    beside = Contention(decode_by_decode=1.5)
    requests = Workload(fixed_lengths(64, 201)).requests(1e6, 2, seed=0)  # both at once

    def tpots(nodes: tuple[int, int]) -> list[float]:
        cluster = ColocatedCluster([contended(n, beside) for n in nodes], chunked)
        return [r.tpot or 0.0 for r in simulate_colocated(cluster, requests).requests]

    apart, together = tpots((0, 1)), tpots((0, 0))
    alone = LatencyModel(COEFFS).decode_step_s(1, 64 + 100)
    assert apart == pytest.approx([alone, alone], rel=0.02)
    assert together == pytest.approx([1.5 * alone, 1.5 * alone], rel=0.02)
    cluster = ColocatedCluster([contended(0, beside)] * 2, chunked)  # one on each replica
    assert [r.instance for r in simulate_colocated(cluster, requests).requests] == [0, 1]


@pytest.mark.parametrize("batch", [1, 8])
def test_a_neighbour_slows_a_decode_step_alike_at_any_batch(batch: int) -> None:
    """`batch` requests at once on each of two replicas of one host, on a model whose
    per-request cost is half of a batch-8 step (the Zen 3's large-batch fit, rounded, at 164
    tokens a request): decoding side by side, each step takes decode_by_decode times as long
    as apart, at batch 8 as at batch 1 (on the Zen 3's recorded runs a decode step beside a
    decoding neighbour ran 1.27-1.36x at every batch from 1 to 4, beside a prefilling one
    1.02-1.09x at every batch from 1 to 12). Slowing only the step's constant and context
    terms priced it 1.43x at batch 1 and 1.24x at batch 8."""
    model = PhaseCoefficients((10.0, 0.1, 0.0), (17.0, 0.0035, 2.9), (17.0, 0.0035, 2.9))
    requests = Workload(fixed_lengths(64, 201)).requests(1e6, 2 * batch, seed=0)

    def tpots(nodes: tuple[int, int]) -> list[float]:
        cluster = ColocatedCluster([contended(n, Contention(decode_by_decode=1.5), model)
                                    for n in nodes])
        return [r.tpot or 0.0 for r in simulate_colocated(cluster, requests).requests]

    apart, together = tpots((0, 1)), tpots((0, 0))
    assert apart == pytest.approx([LatencyModel(model).decode_step_s(
        batch, batch * (64 + 100))] * 2 * batch, rel=0.02)
    assert together == pytest.approx([1.5 * t for t in apart], rel=0.02)


def test_a_tie_goes_to_the_replica_whose_request_already_decodes() -> None:
    """A long prompt on replica 0 and a short one on replica 1 at once; the next request
    comes while the long one still prefills and the short one decodes: one request each,
    so it goes where none awaits its first token (the gateway's key), replica 1."""
    requests = [WorkloadRequest(0.0, 1000, 200), WorkloadRequest(0.0, 10, 200),
                WorkloadRequest(0.05, 10, 20)]  # the long prefill takes 0.11 s
    cluster = ColocatedCluster([contended(n, Contention()) for n in (0, 1)])
    assert [r.instance for r in simulate_colocated(cluster, requests).requests] == [0, 1, 1]


def test_a_decode_instance_slows_while_the_prefill_instance_beside_it_runs() -> None:
    """A long decode, then a stream of prefills on the same host: the decode steps taken
    while a prefill runs cost decode_by_prefill times as long, so its TPOT rises; on another
    host it does not."""
    beside = Contention(decode_by_prefill=1.3)
    first = Workload(fixed_lengths(64, 400)).requests(1e6, 1, seed=0)
    later = Workload(fixed_lengths(1024, 2)).requests(5.0, 40, seed=1)
    requests = first + [dataclasses.replace(r, arrival_s=r.arrival_s + 0.05) for r in later]

    def tpot(decode_node: int) -> float:
        cluster = DisaggregatedCluster([contended(0, beside)], [contended(decode_node, beside)],
                                       Link(1, 1e12, 1e12))
        return simulate_disaggregated(cluster, requests).requests[0].tpot or 0.0

    alone = tpot(decode_node=1)
    assert alone == pytest.approx(LatencyModel(COEFFS).decode_step_s(1, 64 + 200), rel=0.05)
    assert 1.05 * alone < tpot(decode_node=0) <= 1.3 * alone


def test_a_step_is_priced_again_when_a_neighbour_starts_or_ends() -> None:
    """Two replicas on one host, a prompt each, the second arriving halfway through the
    first's prefill; prefill beside prefill runs 1.5x slower. The first runs its first half
    alone and its second at 1/1.5 the pace (D/2 + 0.75 D); the second runs 0.75 D beside it
    (half its work), then the rest alone: both take 1.25 D. Priced once at their start, the
    first took D and the second 1.5 D."""
    beside = Contention(prefill_by_prefill=1.5)
    requests = [WorkloadRequest(0.0, PROMPT, 1), WorkloadRequest(D / 2, PROMPT, 1)]
    cluster = ColocatedCluster([contended(0, beside)] * 2)
    done = simulate_colocated(cluster, requests).requests
    assert [r.instance for r in done] == [0, 1]
    assert [r.ttft for r in done] == pytest.approx([1.25 * D, 1.25 * D])
    apart = ColocatedCluster([contended(0, beside), contended(1, beside)])
    assert [r.ttft for r in simulate_colocated(apart, requests).requests] == \
        pytest.approx([D, D])


def constant(prefill_ms: float, decode_ms: float, beside: Contention = NO_CONTENTION,
             node: int = 0) -> InstanceSpec:
    """Steps of fixed times, whatever their size."""
    model = LatencyModel(PhaseCoefficients((prefill_ms, 0, 0), (decode_ms, 0, 0),
                                           (decode_ms, 0, 0)), contention=beside)
    return InstanceSpec(model, 10**6, max_batch_tokens=1024, node=node)


def test_a_request_heard_mid_step_is_pulled_after_it_and_joins_the_step_after_its_pull() -> None:
    """As the decode service runs a handoff where its pull's blocks are taken on the engine
    thread between steps (on a GPU, or with several ranks), the request joining at a step's
    start: prefills of 5 ms, pulls of 12 ms, decode steps of 10 ms. A is pulled at once (the
    decode instance idles) and steps from 17 ms; B's first token comes at 25 ms, mid-step
    [17, 27]: its pull runs 27-39 ms and it joins the step starting at 47 ms. Pulled at its
    first token, it joined at 37 ms: a recorded humaneval run on the Zen 5, whose decode
    instance took blocks that way, had 153 of 155 requests heard mid-step join where the
    first says, 72 where the second does."""
    prefill, decode = constant(5.0, 10.0, node=0), constant(5.0, 10.0, node=1)
    link = Link(1, 100 / 0.012, 100 / 0.012)  # 100 tokens of 1 byte in 12 ms
    requests = [WorkloadRequest(0.0, 100, 50), WorkloadRequest(0.020, 100, 5)]
    a, b = simulate_disaggregated(DisaggregatedCluster([prefill], [decode], link),
                                  requests).requests
    assert (a.first_token, a.transfer_start, a.decode_start) == pytest.approx(
        (0.005, 0.005, 0.017))
    assert (b.first_token, b.transfer_start, b.transfer_end, b.decode_start) == pytest.approx(
        (0.025, 0.027, 0.039, 0.047))
    assert b.finish == pytest.approx(0.047 + 4 * 0.010)  # output 5: four decode steps
    # a decode instance alone, fed at once: one heard mid-step [10, 20] joins at 30 ms
    alone = simulate_decode_only(decode, [WorkloadRequest(0.0, 100, 50),
                                          WorkloadRequest(0.015, 100, 5)]).requests
    assert (alone[1].transfer_start, alone[1].decode_start) == pytest.approx((0.020, 0.030))


def test_where_blocks_are_taken_beside_a_step_a_pull_landing_mid_step_joins_the_next() -> None:
    """The same handoff where the decode instance takes a pull's blocks beside its step under
    way (one rank on the CPU): B's first token comes at 23 ms, mid-step [17, 27]; its pull
    runs 23-35 ms, mid-step [27, 37], and it joins the step starting at 37 ms, where taking
    its blocks after the step would have pulled it 27-39 ms and joined it at 47 ms."""
    prefill = constant(5.0, 10.0, node=0)
    decode = dataclasses.replace(constant(5.0, 10.0, node=1), pulls_mid_step=True)
    link = Link(1, 100 / 0.012, 100 / 0.012)  # 100 tokens of 1 byte in 12 ms
    requests = [WorkloadRequest(0.0, 100, 50), WorkloadRequest(0.018, 100, 5)]
    for spec, pulled, joined in ((decode, 0.023, 0.037),
                                 (dataclasses.replace(decode, pulls_mid_step=False), 0.027,
                                  0.047)):
        a, b = simulate_disaggregated(DisaggregatedCluster([prefill], [spec], link),
                                      requests).requests
        assert a.decode_start == pytest.approx(0.017)
        assert (b.first_token, b.transfer_start, b.transfer_end, b.decode_start) == \
            pytest.approx((0.023, pulled, pulled + 0.012, joined))
        assert b.finish == pytest.approx(joined + 4 * 0.010)
    # a decode instance alone, fed at once: one heard mid-step [10, 20] joins at 20 ms
    alone = simulate_decode_only(decode, [WorkloadRequest(0.0, 100, 50),
                                          WorkloadRequest(0.015, 100, 5)]).requests
    assert (alone[1].transfer_start, alone[1].decode_start) == pytest.approx((0.015, 0.020))


def test_one_cpu_device_decodes_with_blocks_taken_beside_its_steps() -> None:
    """What the decode service does, as the planner's instances say it: at once on one CPU
    device, between steps with several devices or on a GPU."""
    shipped = load_profile(shipped_cpu_profile(1))
    cpu = dataclasses.replace(shipped, by_tp={1: shipped.by_tp[1], 2: shipped.by_tp[1]})
    gpu = dataclasses.replace(cpu, device="NVIDIA H100 80GB HBM3")
    assert instance_spec(cpu, 1, 1).pulls_mid_step
    assert not instance_spec(cpu, 2, 1).pulls_mid_step
    assert not instance_spec(cpu, 1, 2).pulls_mid_step
    assert not instance_spec(gpu, 1, 1).pulls_mid_step


def timestamps(result: SimResult) -> list[tuple[float, ...]]:
    return [(r.prefill_start, r.first_token, r.transfer_start, r.transfer_end, r.decode_start,
             r.finish, r.instance) for r in result.requests]


def edge_runs(spec: InstanceSpec) -> list[list[tuple[float, ...]]]:
    """Where skipping quiet steps could go wrong: steps of exactly 0.25 s and an arrival at
    exactly 1 s, as a step ends (the arrival comes first); a chunked replica whose decodes
    take its whole token budget (`spec`'s, cut to 3: it admits a waiting prompt a step and
    prefills none); instances of one host that contend unlike, one slowed by nothing (its
    steps skipped) beside one slowed by a prefill or by a decode, whose pace must be priced
    beside the first's decode steps, not as it was beside its prefill or as alone (the
    review's counterexamples)."""
    exact = constant(250.0, 250.0)
    ties = [WorkloadRequest(0.0, 10, 40), WorkloadRequest(1.0, 10, 5)]
    full = dataclasses.replace(spec, max_batch_tokens=3)
    crowded = Workload(fixed_lengths(8, 60)).requests(50.0, 12, seed=7)
    unlike = [constant(100.0, 10.0), constant(1000.0, 10.0, Contention(prefill_by_prefill=2.0))]
    split = DisaggregatedCluster(
        [constant(100.0, 10.0, node=1)],
        [constant(1.0, 400.0, Contention(decode_by_decode=2.0)), constant(1.0, 10.0)],
        Link(1, 1e12, 1e12))
    return [timestamps(simulate_decode_only(exact, ties)),
            timestamps(simulate_colocated(ColocatedCluster([exact]), ties)),
            timestamps(simulate_colocated(ColocatedCluster([full], True), crowded)),
            timestamps(simulate_colocated(ColocatedCluster(unlike), [
                WorkloadRequest(0.0, 10, 50), WorkloadRequest(0.0, 10, 2)])),
            timestamps(simulate_disaggregated(split, [
                WorkloadRequest(0.05, 10, 50), WorkloadRequest(0.0, 10, 2)]))]


SCATTERED = Noise(StepNoise((0.8, 1.0, 1.4), 0.6), StepNoise((0.9, 1.0, 1.2), 0.7), seed=1)


@pytest.mark.parametrize(("contention", "noise"), [(Contention(), Noise()),
                                                   (Contention(1.4, 1.1, 1.2, 1.3), Noise()),
                                                   (Contention(), SCATTERED)])
def test_quiet_decode_steps_taken_at_once_change_no_result(
        monkeypatch: pytest.MonkeyPatch, contention: Contention, noise: Noise) -> None:
    """Decode steps in which nothing happens but the clock are run at once
    (`run_quiet_steps`); every request's every timestamp is the same, to the bit, as when
    each step is an event of its own: both modes, their instances on one host (the steps
    slowed by their neighbours') and apart, a small decode pool, at a low rate (long quiet
    spells) and a high one, and the edges of `edge_runs`; with the steps' times drawn
    (`noise`), each draw goes to the same step either way."""
    mixed = Workload(Lengths(np.array([200, 600, 50, 400]), np.array([120, 240, 2, 30])))
    workloads = [Workload(fixed_lengths(200, 120)).requests(rate, 120, seed=5)
                 for rate in (0.5, 20.0)] + [mixed.requests(8.0, 120, seed=6)]

    def on(node: int, capacity: int = 10**6) -> InstanceSpec:
        return InstanceSpec(LatencyModel(COEFFS, contention=contention), capacity,
                            max_batch_tokens=1024, node=node, noise=noise)

    def runs() -> list[list[tuple[float, ...]]]:
        out = []
        for requests in workloads:
            for nodes in ((0, 0), (0, 1)):
                split = DisaggregatedCluster([on(nodes[0])], [on(nodes[1], 4000)],
                                             Link(1, 1e6, 1e6))
                out.append(timestamps(simulate_disaggregated(split, requests)))
                for chunked in (False, True):
                    replicas = ColocatedCluster([on(n, 3000) for n in nodes], chunked)
                    out.append(timestamps(simulate_colocated(replicas, requests)))
            out.append(timestamps(simulate_decode_only(on(0, 2000), requests)))
        return out + edge_runs(on(0))

    skipped = []

    def counted(*args: Any) -> int:
        skipped.append(run_quiet_steps(*args))
        return skipped[-1]

    for module in (disaggregated, colocated):
        monkeypatch.setattr(module, "run_quiet_steps", counted)
    at_once = runs()
    assert sum(skipped) > 10 * sum(1 for n in skipped if n)  # long quiet spells were skipped
    for module in (disaggregated, colocated):
        monkeypatch.setattr(module, "run_quiet_steps", lambda *_: 0)
    assert runs() == at_once


def test_a_chunk_continuing_a_prompt_is_priced_with_its_cached_tokens() -> None:
    """A 1,024-token prompt on a chunked replica with a 256-token budget runs as four
    chunks over 0, 256, 512 and 768 cached tokens, each priced with d (`prefill_cached`)."""
    co = dataclasses.replace(COEFFS, prefill=(10.0, 0.1, 1e-5), prefill_cached=1e-3)
    replica = InstanceSpec(LatencyModel(co), 10**6, max_batch_tokens=256, max_batch=8)
    request = WorkloadRequest(0.0, 1024, 1)
    result = simulate_colocated(ColocatedCluster([replica], chunked=True), [request])
    chunks = [10.0 + 0.1 * 256 + 1e-5 * 256**2 + 1e-3 * 256 * done
              for done in (0, 256, 512, 768)]
    assert result.requests[0].ttft == pytest.approx(sum(chunks) / 1e3)
    unmeasured = dataclasses.replace(co, prefill_cached=None)  # priced at c, as before
    before = simulate_colocated(ColocatedCluster(
        [dataclasses.replace(replica, latency=LatencyModel(unmeasured))], chunked=True),
        [request])
    assert before.requests[0].ttft == pytest.approx(
        sum(10.0 + 0.1 * 256 + 1e-5 * 256 * (done + 256) for done in (0, 256, 512, 768)) / 1e3)


@pytest.mark.parametrize("system", ["disaggregated", "colocated", "chunked"])
def test_a_prompt_found_in_a_prefix_cache_is_priced_as_its_new_tokens_after_the_cached(
        system: str) -> None:
    """A 1,024-token prompt of which a prefix cache holds 1,008 tokens (a live workload's
    hit): its prefill computes 16 tokens over the 1,008 (priced with `prefill_cached`), on
    every system; its whole KV is held all the same, and a disaggregated pull moves the 16
    new tokens' KV only (the decode instance caches the prefix too)."""
    co = dataclasses.replace(COEFFS, prefill=(10.0, 0.1, 1e-5), prefill_cached=1e-3)
    one = InstanceSpec(LatencyModel(co), 10**6, max_batch_tokens=2048, max_batch=8)
    cached, whole = WorkloadRequest(0.0, 1024, 2, cached_tokens=1008), WorkloadRequest(
        0.0, 1024, 2)

    def run(request: WorkloadRequest) -> Any:
        if system == "disaggregated":
            cluster = DisaggregatedCluster([one], [one], Link(1, 1e5, 1e5))
            return simulate_disaggregated(cluster, [request]).requests[0]
        return simulate_colocated(ColocatedCluster([one], system == "chunked"),
                                  [request]).requests[0]

    hit, miss = run(cached), run(whole)
    assert hit.ttft == pytest.approx((10.0 + 0.1 * 16 + 1e-5 * 16**2 + 1e-3 * 16 * 1008) / 1e3)
    assert miss.ttft == pytest.approx((10.0 + 0.1 * 1024 + 1e-5 * 1024**2) / 1e3)
    if system == "disaggregated":
        assert hit.transfer_end - hit.transfer_start == pytest.approx(16 / 1e5)
        assert miss.transfer_end - miss.transfer_start == pytest.approx(1024 / 1e5)
    # a prompt said to be cached whole computes its last token (an engine samples from it)
    whole_hit = run(WorkloadRequest(0.0, 1024, 2, cached_tokens=1024))
    assert whole_hit.done and whole_hit.ttft == pytest.approx(
        (10.0 + 0.1 + 1e-5 + 1e-3 * 1023) / 1e3)


def test_a_workload_seen_live_draws_each_requests_cached_tokens_with_its_lengths() -> None:
    """The cached tokens travel with their request through the draw (the same draws as
    without them: common random numbers), a context's filter and a model's clip."""
    prompts, outputs = np.array([100, 400, 900]), np.array([10, 20, 30])
    lengths = Lengths(prompts, outputs, np.array([0, 384, 896]))
    drawn = Workload(lengths).requests(2.0, 50, seed=5)
    plain = Workload(Lengths(prompts, outputs)).requests(2.0, 50, seed=5)
    assert [(r.arrival_s, r.prompt_tokens) for r in drawn] == \
        [(r.arrival_s, r.prompt_tokens) for r in plain]
    assert {(r.prompt_tokens, r.cached_tokens) for r in drawn} == {(100, 0), (400, 384),
                                                                    (900, 896)}
    assert all(r.cached_tokens == 0 for r in plain)
    within = lengths.within(500)
    assert within.cached is not None and within.cached.tolist() == [0, 384]
    clipped = lengths.clipped(max_prompt=512, max_total=600)
    assert clipped.cached is not None and clipped.cached.tolist() == [0, 384, 511]
    with pytest.raises(ValueError, match="cached tokens"):
        Lengths(prompts, outputs, np.array([0, 400, 0]))
