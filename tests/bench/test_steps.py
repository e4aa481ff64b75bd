"""The engine steps a benchmark records from the workers' heartbeats, and the simulation of
each rate on them (pure; the recorder against a real stack is in test_loadgen.py)."""

import dataclasses
import json
import statistics
from pathlib import Path

import pytest

from distserve.bench.compare import (
    DRAWS,
    Measured,
    recorded,
    simulate,
    simulate_live,
    systems,
)
from distserve.bench.results import RequestRecord, RunResult
from distserve.bench.runner import Unloaded, system_report
from distserve.bench.steps import (
    StepLog,
    calibration_of,
    calibrator_of,
    live_profile,
    steps_from_json,
    steps_to_json,
)
from distserve.bench.workload import Limits, parse_bench_workload
from distserve.cli import main
from services.planner.calibration import ALONE, MOMENTS
from services.planner.latency import Contention
from services.planner.profiles import load_profile, shipped_cpu_profile
from shared.metrics import SLO
from shared.state import StepSample

PROFILE = load_profile(shipped_cpu_profile(1))
LATENCY = PROFILE.latency(1, 1)
CONTENDED = dataclasses.replace(PROFILE, contention=Contention(
    decode_by_decode=1.5, decode_by_prefill=1.2, prefill_by_decode=1.1))


def decode(step: int, batch: int, context: int, slower: float = 1.0) -> StepSample:
    return StepSample(step=step, batch=batch, context=context,
                      seconds=slower * LATENCY.decode_step_s(batch, context))


def prefill(step: int, prompt: int, slower: float = 1.0) -> StepSample:
    return StepSample(step=step, prompts=[prompt],
                      seconds=slower * LATENCY.prefill_latency_s(prompt, prompt * prompt))


def test_overlapping_heartbeats_keep_each_step_once() -> None:
    """A heartbeat carries a worker's last steps, so two in a row share most of them."""
    log = StepLog()
    assert log.add("d", [decode(i, 1, 100) for i in range(1, 6)]) == 5
    assert log.add("d", [decode(i, 1, 100) for i in range(3, 9)]) == 3
    assert log.add("p", [prefill(1, 64)]) == 1
    taken = log.take()
    assert [s.step for s in taken["d"]] == list(range(1, 9)) and len(taken["p"]) == 1
    # a take forgets the steps, not where each instance got to
    assert log.take() == {}
    assert log.add("d", [decode(i, 1, 100) for i in range(7, 11)]) == 2
    assert [s.step for s in log.take()["d"]] == [9, 10]


def test_steps_survive_results_json() -> None:
    steps = {"d": [decode(1, 2, 300), decode(2, 2, 302)], "p": [prefill(1, 40)]}
    steps["d"][1].ended = 1764000000.25
    again = steps_from_json(json.loads(json.dumps(steps_to_json(steps))))
    assert again.keys() == steps.keys()
    for instance, samples in steps.items():
        assert [(s.step, s.prompts, s.batch, s.context, s.ended) for s in again[instance]] \
            == [(s.step, s.prompts, s.batch, s.context, s.ended) for s in samples]
        assert [s.seconds for s in again[instance]] == pytest.approx(
            [s.seconds for s in samples], abs=1e-6)


def test_the_calibration_of_recorded_steps_is_the_online_planners() -> None:
    """Decode steps 30% slower than the profile at every batch and context, prefills as
    profiled: the calibration finds both."""
    steps = {"decode-0": [decode(i, 1 + i % 7, 200 * (1 + i % 7), slower=1.3)
                          for i in range(1, 40)],
             "prefill-0": [prefill(i, 100 + 37 * i) for i in range(1, 15)]}
    found = calibration_of(steps, LATENCY)
    assert found.decode == pytest.approx(1.3, rel=0.01) and found.decode_steps == 39
    assert found.prefill == pytest.approx(1.0, rel=0.01) and found.prefill_steps == 14
    # too few steps of a phase to say: as profiled
    assert calibration_of({"p": [prefill(1, 64, slower=2.0)]}, LATENCY).prefill == 1.0


def decoding(start: float, step_s: float, n: int, first: int = 1) -> list[StepSample]:
    """`n` back-to-back batch-1 decode steps of `step_s` from `start`, with their end times."""
    return [StepSample(step=first + k, batch=1, context=200, seconds=step_s,
                       ended=start + (k + 1) * step_s) for k in range(n)]


def test_steps_beside_another_instances_give_the_contention_the_rest_the_level() -> None:
    """Two replicas on one host: the first decodes alone for a while (its steps 1.2x the
    profile), then both decode together, every step 1.8x. The live profile prices a step
    alone and a step beside a decoding neighbour as they ran; the contention of the
    profile (fitted elsewhere) gives way to the measured one."""
    alone_s = 1.2 * LATENCY.decode_step_s(1, 200)
    beside_s = 1.8 * LATENCY.decode_step_s(1, 200)
    steps = {"colocated-0": decoding(0.0, alone_s, 40) + decoding(10.0, beside_s, 40, 41),
             "colocated-1": decoding(10.0 + beside_s / 2, beside_s, 40)}
    placed = calibrator_of(steps, LATENCY).placed("decode")
    assert sum(moments == ALONE for _, moments in placed) == 40
    # all of 78 steps beside the other's decodes, half of the first and last one's
    assert sum(moments == (("decode",),) * MOMENTS for _, moments in placed) == 78
    live = live_profile(steps, CONTENDED)
    assert live.calibration.decode_basis == "alone"
    assert live.calibration.contention.keys() == {"decode_by_decode"}
    contention = live.profile.contention
    assert contention != CONTENDED.contention
    latency = live.profile.latency(1, 1)
    alone = latency.decode_step_s(1, 200)
    assert alone == pytest.approx(alone_s, rel=0.02)
    assert alone * contention.factor("decode", ["decode"]) == pytest.approx(beside_s,
                                                                            rel=0.02)
    # steps never beside a prefill: the profile's own factor stays
    assert contention.decode_by_prefill == CONTENDED.contention.decode_by_prefill == 1.2
    assert "decode beside a decode 1." in live.describe()
    # every step ran as the fit and its contention price it (but the two half beside a
    # neighbour, taking a whole step's time beside it): its noise is none to speak of
    # (the steps beside a neighbour priced at their contention, not read as 1.5x slower)
    noise = live.noise.decode
    assert noise is not None and live.noise.prefill is None
    assert noise.ratio_at(0.05) == pytest.approx(1.0, abs=0.01)
    assert noise.ratio_at(0.95) == pytest.approx(1.0, abs=0.01)


def test_the_live_noise_is_the_steps_spread_and_spells_around_the_fit() -> None:
    """One decode instance alone whose steps alternate spells of ten at 1.0x and ten at
    1.25x the profile: the noise around the fit spans those 25%, with half the steps at
    each level, and a step follows the one before (lag-1 near 1: spells)."""
    step_s = LATENCY.decode_step_s(1, 200)
    slower = [1.0 + 0.25 * (k // 10 % 2) for k in range(200)]
    ends = [sum(slower[:k + 1]) * step_s for k in range(200)]
    steps = {"decode-0": [StepSample(step=k + 1, batch=1, context=200,
                                     seconds=slower[k] * step_s, ended=ends[k])
                          for k in range(200)]}
    live = live_profile(steps, PROFILE)
    noise = live.noise.decode
    assert noise is not None
    assert noise.ratio_at(0.9) / noise.ratio_at(0.1) == pytest.approx(1.25, rel=0.01)
    assert noise.ratio_at(0.25) == noise.ratio_at(0.1) and noise.ratio_at(0.75) == \
        noise.ratio_at(0.9)
    assert noise.lag1 > 0.8
    assert "decode x" in live.describe_noise() and "lag-1 0.80" in live.describe_noise()


def test_the_noise_a_step_of_any_size_draws_averages_1_about_a_level_that_adds_up() -> None:
    """A prefill instance alone whose 32-token prompts run 1.5x the profile and 512-token
    ones 1.0x, by turns: the level is their total over the predicted total (near 1.0x, the
    long steps' time), so the steps' ratios to it average above 1; the noise the simulator
    draws for a step of any size is of those ratios scaled to average the steps' total over
    their priced total (1 here), so the steps the level prices add up to their total again."""
    sizes = [32 if k % 2 else 512 for k in range(60)]
    took = [LATENCY.prefill_latency_s(p, p * p) * (1.5 if p == 32 else 1.0) for p in sizes]
    ends = [sum(took[:k + 1]) for k in range(60)]
    steps = {"prefill-0": [StepSample(step=k + 1, prompts=[p], seconds=took[k], ended=ends[k])
                           for k, p in enumerate(sizes)]}
    live = live_profile(steps, PROFILE)
    latency = live.profile.latency(1, 1)
    priced = [latency.prefill_latency_s(p, p * p) for p in sizes]
    assert sum(priced) == pytest.approx(sum(took), rel=1e-3)
    ratios = [t / p for t, p in zip(took, priced, strict=True)]
    assert statistics.fmean(ratios) > 1.05  # what the draws would add, taken as they ran
    noise = live.noise.prefill
    assert noise is not None
    assert statistics.fmean(noise.ratio_at(k / 200) for k in range(201)) == pytest.approx(
        1.0, abs=0.01)


def requests(rate: float, n: int, prompt: int, output: int) -> list[RequestRecord]:
    return [RequestRecord(i, i / rate, prompt, output, sent_s=i / rate,
                          first_token_s=i / rate + 0.3, last_token_s=i / rate + 1.0,
                          tokens=output, request_id=f"r{i}") for i in range(n)]


def test_each_rate_is_simulated_on_the_steps_the_stack_ran_at_it() -> None:
    """The same requests at one rate with steps recorded 1.5x slower than the profile's
    (decode and prefill), at another with none (a run recorded before steps were): the
    first simulates 1.5x slower steps than the profile as fitted, the second is not
    simulated on steps at all."""
    disaggregated = systems(1, 256, chunked=False)[0]
    workload = parse_bench_workload("fixed:256:16", Limits())
    steps = {"prefill-0": [prefill(i, 256, slower=1.5) for i in range(1, 13)],
             "decode-0": [decode(i, 1 + i % 3, (1 + i % 3) * 260, slower=1.5)
                          for i in range(1, 60)]}
    runs = [RunResult(0.2, requests(0.2, 12, 256, 16), 60.0, steps=steps),
            RunResult(0.4, requests(0.4, 12, 256, 16), 30.0)]
    measured = Measured(disaggregated, runs, Unloaded(0.5, 0.03, 256), 1e9, {})
    slo = SLO(2.0, 0.1)
    live = simulate_live(measured, CONTENDED, workload, slo)
    assert live[1] is None
    assert live[0] is not None
    fit, sim = live[0].live, live[0].result
    # the steps all ran as the fit prices them: every draw of their noise simulates the same
    assert len(live[0].draws) == DRAWS and set(live[0].draws) == {sim.attainment(slo)}
    assert live[0].band() == (sim.attainment(slo),) * 3
    # the steps do not say when they ran: fitted on all of them, which carry their
    # contention (none on top)
    assert fit.calibration.decode_basis == "all" and fit.profile.contention.none
    assert fit.calibration.decode == pytest.approx(1.5, rel=0.01)
    assert fit.calibration.prefill == pytest.approx(1.5, rel=0.01)
    (raw, _) = simulate(measured, PROFILE, workload, slo, calibrate=False)

    def median_tpot(result: object) -> float:
        return statistics.median(r.tpot for r in result.requests)  # type: ignore[attr-defined]

    assert median_tpot(sim) / median_tpot(raw) == pytest.approx(1.5, rel=0.1)


def test_a_recorded_comparison_with_steps_is_simulated_on_them_again(tmp_path: Path) -> None:
    """`bench compare --from` reads the steps back and writes each rate's simulation on
    them beside the others (null where a run has none)."""
    slo, unloaded = SLO(1.0, 0.05), Unloaded(0.2, 0.025, 128)
    steps = {"prefill-0": [prefill(i, 128) for i in range(1, 13)],
             "decode-0": [decode(i, 1, 130) for i in range(1, 60)]}
    reports = []
    for system in systems(1, 256, chunked=True):
        spans = {"prefill run": 0.15, "decode run": 0.2} if system.mode == "disaggregated" else {}
        runs = [RunResult(rate, requests(rate, 6, 128, 8), 6 / rate, breakdown_s=spans,
                          steps=steps if rate == 0.5 else {}) for rate in (0.5, 2.0)]
        reports.append(system_report(system.name, system.devices, runs, slo, 0.9) | {
            "cores_used": {}, "kv_link_bps": 6e8, "unloaded": unloaded.__dict__})
    path = tmp_path / "results.json"
    path.write_text(json.dumps({
        "workload": "fixed:128:8", "slo": slo.__dict__, "threads_per_worker": 1,
        "kv_cache_mb": 256, "attainment_target": 0.9, "rates": [0.5, 2.0],
        "unloaded": unloaded.__dict__, "systems": reports}))
    measured = recorded(json.loads(path.read_text()))
    assert len(measured[0].runs[0].steps["decode-0"]) == 59 and measured[0].runs[1].steps == {}
    out = tmp_path / "again"
    assert main(["bench", "compare", "--from", str(path), "--workload", "fixed:128:8",
                 "--profile", str(shipped_cpu_profile(1)), "--out", str(out)]) == 0
    for system in json.loads((out / "results.json").read_text())["systems"]:
        live = system["simulated_attainment_live"]
        assert live[1] is None and 0.0 <= live[0] <= 1.0
        # steps as profiled: the calibration is the profile's own, and they scatter not at
        # all around it (59 decode steps: their noise, all 1.0; too few prefills for one)
        assert system["live_calibration"][0]["decode"] == pytest.approx(1.0, rel=0.01)
        noise = system["live_noise"][0]
        assert noise["prefill"] is None and noise["decode"]["ratios"] == pytest.approx(
            [1.0] * 41, rel=1e-3)
        draws = system["simulated_attainment_live_draws"]
        assert len(draws[0]) == DRAWS and set(draws[0]) == {live[0]} and draws[1] is None
        assert system["runs"][0]["steps"]["decode-0"][0][:4] == [1, [], 1, 130]
        # where the live simulation's time went, beside the spans' (a disaggregated stack's)
        staged = system["live_stages_s"]
        assert staged[1] is None
        if system["name"].startswith("disaggregated"):
            assert list(staged[0]) == ["prefill run", "decode run"]
            assert staged[0]["decode run"][0] == 0.2 and staged[0]["decode run"][1] > 0
        else:
            assert staged[0] == {}
