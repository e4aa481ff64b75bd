"""The pure parts of `distserve bench compare`: systems, calibration, default rates, the
simulation of a recorded comparison."""

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from distserve.bench.compare import (
    Measured,
    RateGrid,
    auto_rates,
    cache_fits,
    calibrated_profile,
    calibration_from,
    fidelity,
    next_rate,
    recommend,
    recorded,
    simulate,
    systems,
)
from distserve.bench.results import RequestRecord, RunResult
from distserve.bench.runner import CALIBRATION_TOKENS, Unloaded, system_report
from distserve.bench.workload import Limits, parse_bench_workload
from distserve.cli import main
from distserve.commands.bench import recommendation
from services.planner.profiles import load_profile, shipped_cpu_profile
from services.planner.simulator.core import SimRequest, SimResult
from shared.metrics import SLO
from shared.workloads import cached_in


def test_calibration_makes_the_profile_predict_the_measured_unloaded_latencies() -> None:
    profile = load_profile(shipped_cpu_profile(1))
    latency = profile.latency(1, 1)
    measured = Unloaded(ttft_s=1.3, tpot_s=0.07, prompt_tokens=512)
    scaled = calibration_from(latency, measured).apply(profile).latency(1, 1)
    assert scaled.prefill_latency_s(512, 512 * 512) == pytest.approx(1.3)
    assert scaled.decode_step_s(1, 512 + CALIBRATION_TOKENS / 2) == pytest.approx(0.07)
    # a KV transfer inside the measured TPOT is left to the simulator's link
    less = calibration_from(latency, measured, transfer_s=0.15).apply(profile).latency(1, 1)
    assert less.decode_step_s(1, 512 + CALIBRATION_TOKENS / 2) == pytest.approx(
        0.07 - 0.15 / (CALIBRATION_TOKENS - 1))
    # the shape stays: a longer prompt costs the same multiple more
    ratio = latency.prefill_latency_s(1024, 1024**2) / latency.prefill_latency_s(512, 512**2)
    assert scaled.prefill_latency_s(1024, 1024**2) / 1.3 == pytest.approx(ratio)


def test_a_disaggregated_stack_is_calibrated_less_its_measured_handoff() -> None:
    """The probes' handoff (their spans') comes out of the decode steps, not the KV's bytes
    at the link's rate: an idle pull can take far longer than the bytes say, and left in
    the decode steps it slows every step the simulator prices."""
    profile = load_profile(shipped_cpu_profile(1))
    disaggregated = systems(1, 128, chunked=False)[0]
    decode_s = profile.latency(1, 1).decode_step_s(1, 512 + CALIBRATION_TOKENS / 2)

    def calibrated(unloaded: Unloaded, link_bps: float | None = 1e9) -> float:
        measured = Measured(disaggregated, [], unloaded, link_bps, {})
        return calibrated_profile(measured, profile).latency(1, 1).decode_step_s(
            1, 512 + CALIBRATION_TOKENS / 2) / decode_s

    spanned = Unloaded(1.3, 0.07, 512, handoff_s=0.15)
    assert calibrated(spanned) == pytest.approx(calibration_from(
        profile.latency(1, 1), spanned, 0.15).decode)
    # without the spans (a run recorded before them): the KV's bytes at the link's rate
    kv_s = profile.model.kv_bytes_per_token * 512 / 1e9
    bare = Unloaded(1.3, 0.07, 512)
    assert calibrated(bare) == pytest.approx(calibration_from(
        profile.latency(1, 1), bare, kv_s).decode)
    assert calibrated(spanned) < calibrated(bare)


def test_both_systems_get_two_workers_and_the_same_threads() -> None:
    disaggregated, colocated, chunked = systems(threads=1, kv_cache_mb=128, chunked=True)
    assert disaggregated.devices == colocated.devices == chunked.devices == 2
    assert {s.stack.threads for s in (disaggregated, colocated, chunked)} == {1}
    assert chunked.stack.chunked_prefill and not colocated.stack.chunked_prefill
    assert len(systems(1, 128, chunked=False)) == 2
    # the workers cache prefixes for a workload whose prompts share them only
    assert not any(s.stack.prefix_caching for s in (disaggregated, colocated, chunked))
    assert all(s.stack.prefix_caching for s in systems(1, 128, True, prefix_caching=True))


def test_a_run_whose_stack_found_prompts_cached_is_simulated_with_them(
        tmp_path: Path) -> None:
    """A request's record says how many of its prompt's tokens the stack found cached: its
    simulation prices those as not computed (a shorter prefill)."""
    report = recorded_comparison(tmp_path / "results.json")
    report["prefix_caching"] = True
    for system in report["systems"]:
        for run in system["runs"]:
            for record in run["records"]:
                record["cached_tokens"] = 96 if record["index"] % 2 else 0
    measured = recorded(report)
    assert all(m.system.stack.prefix_caching for m in measured)
    profile, slo = load_profile(shipped_cpu_profile(1)), SLO(1.0, 0.05)
    workload = parse_bench_workload("fixed:128:8", Limits())
    cached = simulate(measured[0], profile, workload, slo)[0].requests
    assert [r.cached for r in cached] == [0, 96] * 3
    plain = simulate(recorded(recorded_comparison(tmp_path / "plain.json"))[0], profile,
                     workload, slo)[0].requests
    assert [r.cached for r in plain] == [0] * 6

    def prefill_s(r: SimRequest) -> float:
        return r.first_token - r.prefill_start

    assert prefill_s(cached[1]) < prefill_s(plain[1])
    assert prefill_s(cached[0]) == pytest.approx(prefill_s(plain[0]))


def test_disaggregation_is_compared_with_the_better_colocated_format(tmp_path: Path) -> None:
    """With --decode-weights int4 colocated replicas run in float32 and in int4; the ratio
    is taken against whichever has the higher goodput (here int4's, which meets the TPOT
    at 2 req/s where float32's does not)."""
    recorded_comparison(tmp_path / "results.json", decode_weights="int4")
    out = tmp_path / "again"
    assert main(["bench", "compare", "--from", str(tmp_path / "results.json"), "--workload",
                 "fixed:128:8", "--out", str(out)]) == 0
    again = json.loads((out / "results.json").read_text())
    goodputs = {s["name"]: s["per_device_goodput_rps"] for s in again["systems"]}
    assert goodputs["colocated x2 (int4)"] > goodputs["colocated x2"]
    assert again["colocated_baseline"] == "colocated x2 (int4)"
    assert again["ratio_disaggregated_to_colocated"] == pytest.approx(
        goodputs["disaggregated 1P+1D (decode int4)"] / goodputs["colocated x2 (int4)"])


def test_a_decode_format_goes_to_the_decode_instance_only() -> None:
    """`--decode-weights int4`: the disaggregated decode instance runs int4 beside a float32
    prefill instance; colocated workers run one format for both phases, so they run in each;
    names say so, and a recorded run maps back to its systems by them."""
    disaggregated, colocated, chunked, colocated4 = systems(1, 128, chunked=True,
                                                           decode_weights="int4")
    assert disaggregated.stack.weights_for("decode") == "int4"
    assert disaggregated.stack.weights_for("prefill") == "auto"
    assert colocated.stack.weights_for("colocated") == chunked.stack.weights == "auto"
    assert colocated4.stack.weights_for("colocated") == "int4"  # one format for both phases
    assert disaggregated.name == "disaggregated 1P+1D (decode int4)"
    assert [colocated.name, colocated4.name] == ["colocated x2", "colocated x2 (int4)"]
    assert colocated4.devices == 2 and colocated4.mode == "colocated"
    every = systems(1, 128, chunked=False, weights="int8")
    assert [s.name for s in every] == ["disaggregated 1P+1D (int8)", "colocated x2 (int8)"]
    assert every[0].stack.weights_for("decode") == every[1].stack.weights == "int8"
    both = systems(1, 128, chunked=False, weights="int8", decode_weights="int4")
    assert [s.name for s in both] == ["disaggregated 1P+1D (int8, decode int4)",
                                      "colocated x2 (int8)", "colocated x2 (int4)"]
    report = {"threads_per_worker": 1, "kv_cache_mb": 128, "decode_weights": "int4", "systems": [
        {"name": disaggregated.name, "runs": [], "unloaded": Unloaded(0.2, 0.02, 8).__dict__}]}
    assert recorded(report)[0].system == disaggregated


def test_a_prefill_dtype_goes_to_the_prefill_instance_only() -> None:
    """`--prefill-dtype bfloat16`: the disaggregated prefill instance computes in bfloat16
    beside a float32 decode instance; colocated replicas run in each; a recorded run maps
    back to its systems."""
    disaggregated, colocated, bf16 = systems(1, 128, chunked=False, prefill_dtype="bfloat16")
    assert disaggregated.stack.dtype_for("prefill") == "bfloat16"
    assert disaggregated.stack.dtype_for("decode") == colocated.stack.dtype_for("colocated") \
        == "auto"
    assert bf16.stack.dtype_for("colocated") == "bfloat16" and bf16.devices == 2
    assert [s.name for s in (disaggregated, colocated, bf16)] == [
        "disaggregated 1P+1D (prefill bfloat16)", "colocated x2", "colocated x2 (bfloat16)"]
    both = systems(1, 128, chunked=False, decode_weights="int4", prefill_dtype="bfloat16")
    assert both[0].name == "disaggregated 1P+1D (prefill bfloat16, decode int4)"
    assert both[0].stack.weights_for("decode") == "int4"
    assert [s.name for s in both[1:]] == ["colocated x2", "colocated x2 (int4)",
                                          "colocated x2 (bfloat16)"]
    report = {"threads_per_worker": 1, "kv_cache_mb": 128, "prefill_dtype": "bfloat16",
              "systems": [{"name": bf16.name, "runs": [],
                           "unloaded": Unloaded(0.2, 0.02, 8).__dict__}]}
    assert recorded(report)[0].system == bf16


def test_default_rates_scale_with_unloaded_capacity() -> None:
    unloaded = Unloaded(ttft_s=1.0, tpot_s=0.05, prompt_tokens=512)
    # 2 workers / (1 s + 32 x 0.05 s) = 0.769 req/s
    assert auto_rates(unloaded, 32, 2, (0.5, 1.0)) == [0.385, 0.769]


def run_at(rate: float, met: int, of: int = 10) -> RunResult:
    """A run at `rate` where `met` of `of` requests meet SLO(1 s, 0.1 s)."""
    records = [RequestRecord(i, 0.0, 64, 11, sent_s=0.0, first_token_s=0.5 if i < met else 3,
                             last_token_s=(0.5 if i < met else 3) + 10 * 0.05, tokens=11)
               for i in range(of)]
    return RunResult(rate, records, 10.0)


def test_past_the_grid_each_system_runs_until_its_goodput_is_bracketed() -> None:
    slo, grid = SLO(1.0, 0.1), 2
    met_everywhere = [run_at(0.5, 10), run_at(1.0, 9)]
    assert next_rate(met_everywhere, slo, 0.9, grid, most=3) == 1.5  # 1.5x the highest
    assert next_rate([*met_everywhere, run_at(1.5, 9)], slo, 0.9, grid, 3) == 2.25
    # bracketed: a rate that met the target and one that did not
    assert next_rate([*met_everywhere, run_at(1.5, 6)], slo, 0.9, grid, 3) is None
    assert next_rate([run_at(0.5, 10), run_at(1.0, 5)], slo, 0.9, grid, 3) is None
    # met nowhere: below the lowest rate
    assert next_rate([run_at(0.6, 5), run_at(1.0, 2)], slo, 0.9, grid, 3) == 0.4
    # the lowest rate missed, a higher one met (noise): the goodput would be 0, so below too
    assert next_rate([run_at(0.6, 8), run_at(1.0, 9)], slo, 0.9, grid, 3) == 0.4
    assert next_rate([run_at(0.0006, 5), run_at(1.0, 9)], slo, 0.9, grid, 3) is None  # not 0
    # the extension is spent, or off, or the grid is not done yet
    spent = [*met_everywhere, run_at(1.5, 10), run_at(2.25, 10), run_at(3.375, 10)]
    assert next_rate(spent, slo, 0.9, grid, 3) is None
    assert next_rate(met_everywhere, slo, 0.9, grid, 0) is None
    assert next_rate(met_everywhere[:1], slo, 0.9, grid, 3) is None


def test_the_first_system_sets_the_grid_and_objectives_for_all() -> None:
    grid = RateGrid((0.5, 1.0), 32, lambda u: u.slo(5, 1.5), 0.9, extend=2)
    first, second = Unloaded(1.0, 0.05, 512), Unloaded(2.0, 0.1, 512)
    assert grid.start(first) == [0.385, 0.769] == grid.start(second)
    assert grid.slo is not None and (grid.slo.ttft_s, grid.slo.tpot_s) == pytest.approx(
        (5.0, 0.075))
    assert grid.more([run_at(0.385, 10), run_at(0.769, 10)]) == pytest.approx(1.153)
    given = RateGrid((0.5, 1.0), 32, lambda u: u.slo(5, 1.5), 0.9, 0, rates=[0.3])
    assert given.start(first) == [0.3] and given.more([run_at(0.3, 10)]) is None


def measured(mode_index: int, unloaded: Unloaded) -> Measured:
    return Measured(systems(1, 256, chunked=True)[mode_index], [], unloaded, None, {})


def test_the_recommendation_sits_next_to_the_measured_ranking() -> None:
    """Long prompts and a TPOT of 1.5x the unloaded one: the planner's simulator picks
    disaggregation on this CPU's profile; the report ranks what was measured and says how
    the pick fared."""
    profile = load_profile(shipped_cpu_profile(1))
    unloaded = Unloaded(ttft_s=1.05, tpot_s=0.054, prompt_tokens=512)
    workload = parse_bench_workload("fixed:512:32", Limits())
    runs = [measured(i, unloaded) for i in range(3)]
    found = recommend(runs[0], profile, workload, SLO(5.25, 0.081), 0.9, rate=0.45)
    assert [c.mode for c in found] == ["disaggregated", "colocated", "chunked"]
    reports = [{"per_device_goodput_rps": g} for g in (0.12, 0.10, 0.13)]
    rec = recommendation(found, runs, reports)
    assert rec["mode"] == "disaggregated"
    assert [m["mode"] for m in rec["measured_ranking"]] == ["chunked", "disaggregated",
                                                             "colocated"]
    assert [m["system"] for m in rec["measured_ranking"]] == [
        "chunked x2", "disaggregated 1P+1D", "colocated x2"]
    assert rec["recommended_vs_best_measured"] == pytest.approx(0.12 / 0.13)
    assert len(rec["simulated"]) == 3


def test_fidelity_compares_the_same_requests_one_by_one() -> None:
    """Median measured - simulated TTFT and TPOT over the same requests, and the requests
    whose outcome differs: one a few ms either side of the TPOT objective (near), one the
    simulator sends to a queue the stack did not (far)."""
    slo = SLO(ttft_s=2.0, tpot_s=0.100)
    timings = [  # (measured TTFT, TPOT), (simulated TTFT, TPOT), 11 output tokens
        ((1.0, 0.080), (0.9, 0.078)),
        ((1.2, 0.098), (1.0, 0.103)),  # flips on 5 ms: near
        ((1.1, 0.090), (3.5, 0.090)),  # queued in the simulation only: far
        ((1.0, 0.070), (0.8, 0.070)),
    ]
    records, simulated = [], []
    for i, ((ttft, tpot), (sim_ttft, sim_tpot)) in enumerate(timings):
        records.append(RequestRecord(i, 0.0, 512, 11, sent_s=0.0, first_token_s=ttft,
                                     last_token_s=ttft + 10 * tpot, tokens=11))
        simulated.append(SimRequest(i, 0.0, 512, 11, first_token=sim_ttft,
                                    finish=sim_ttft + 10 * sim_tpot))
    found = fidelity(RunResult(0.5, records, 10.0), SimResult(simulated), slo)
    assert found.differ == 2 and found.near == 1
    assert found.ttft_s == pytest.approx(0.15)  # the median of +0.1, +0.2, -2.4, +0.2 s
    assert found.tpot_s == pytest.approx(0.0, abs=1e-9)  # of +2, -5, 0, 0 ms
    assert found.to_json()["differ"] == 2


def test_fidelity_puts_each_stage_measured_beside_simulated() -> None:
    """A disaggregated run's stages from its spans beside the simulator's for the same
    requests: where a TPOT gap comes from (here the decode run, slower in the stack)."""
    records = [RequestRecord(i, 0.0, 128, 11, sent_s=0.0, first_token_s=0.5,
                             last_token_s=1.5, tokens=11) for i in range(2)]
    simulated = [SimRequest(i, 0.0, 128, 11, prefill_start=0.1, first_token=0.4,
                            transfer_start=0.4, transfer_end=0.45, decode_start=0.46,
                            finish=1.26) for i in range(2)]
    measured = {"prefill queue": 0.1, "prefill run": 0.35, "kv transfer": 0.06,
                "decode queue": 0.01, "decode run": 0.98}
    found = fidelity(RunResult(0.5, records, 10.0, measured), SimResult(simulated),
                     SLO(2.0, 0.1))
    assert list(found.stages_s) == list(measured)
    # the decode run from the KV's landing, as the spans cut it: its wait for a step's start
    # (0.45 -> 0.46) in it, not in the decode queue (first token -> the pull's start)
    assert found.stages_s["decode run"] == pytest.approx((0.98, 0.81))
    assert found.stages_s["decode queue"] == pytest.approx((0.01, 0.0))
    assert found.stages_s["kv transfer"] == pytest.approx((0.06, 0.05))
    assert found.stages_s["prefill queue"] == pytest.approx((0.1, 0.1))
    # a colocated run's spans time no stage: nothing to put side by side
    assert fidelity(RunResult(0.5, records, 10.0), SimResult(simulated),
                    SLO(2.0, 0.1)).stages_s == {}


def recorded_comparison(path: Path, decode_weights: str = "") -> dict[str, Any]:
    """A results.json as `bench compare --chunked` writes it: three systems (four with
    `decode_weights`), two rates, six requests each (fixed 128-token prompts, 8 tokens out);
    a colocated system in another format meets the TPOT at the higher rate too."""
    slo, unloaded = SLO(1.0, 0.05), Unloaded(0.2, 0.025, 128)
    reports = []
    for system in systems(1, 256, chunked=True, decode_weights=decode_weights):
        runs = []
        fast = system.stack.weights != "auto"
        for rate, tpot in ((0.5, 0.03), (2.0, 0.04 if fast else 0.06)):
            records = [RequestRecord(i, i / rate, 128, 8, sent_s=i / rate,
                                     first_token_s=i / rate + 0.25,
                                     last_token_s=i / rate + 0.25 + 7 * tpot, tokens=8,
                                     request_id=f"r{i}") for i in range(6)]
            runs.append(RunResult(rate, records, 6 / rate))
        reports.append(system_report(system.name, system.devices, runs, slo, 0.9) | {
            "cores_used": {}, "kv_link_bps": 6e8, "unloaded": unloaded.__dict__})
    report = {"workload": "fixed:128:8", "slo": slo.__dict__, "threads_per_worker": 1,
              "kv_cache_mb": 256, "decode_weights": decode_weights,
              "attainment_target": 0.9, "rates": [0.5, 2.0],
              "unloaded": unloaded.__dict__, "systems": reports}
    path.write_text(json.dumps(report))
    return report


def test_a_recorded_comparison_is_simulated_again_on_the_requests_it_sent(
        tmp_path: Path) -> None:
    """`bench compare --from results.json` starts nothing: the recorded systems, their
    requests (arrivals and lengths) simulated again, the report and the planner's pick."""
    report = recorded_comparison(tmp_path / "results.json")
    measured = recorded(report)
    assert [m.system.mode for m in measured] == ["disaggregated", "colocated", "chunked"]
    assert measured[0].link_bps == 6e8 and measured[1].unloaded.prompt_tokens == 128
    workload = parse_bench_workload("fixed:128:8", Limits())
    sims = simulate(measured[1], load_profile(shipped_cpu_profile(1)), workload, SLO(1.0, 0.05))
    assert len(sims) == 2
    assert [r.arrival for r in sims[1].requests] == [i / 2.0 for i in range(6)]
    assert {(r.prompt, r.output) for r in sims[1].requests} == {(128, 8)}

    out = tmp_path / "again"
    assert main(["bench", "compare", "--from", str(tmp_path / "results.json"), "--workload",
                 "fixed:128:8", "--out", str(out)]) == 0
    again = json.loads((out / "results.json").read_text())
    for before, after in zip(report["systems"], again["systems"], strict=True):
        assert [r["attainment"] for r in after["runs"]] == \
            [r["attainment"] for r in before["runs"]]  # what was measured stays
        assert len(after["simulated_attainment"]) == len(after["fidelity"]) == 2
    assert again["recommendation"]["mode"] in {"disaggregated", "colocated", "chunked"}
    assert again["colocated_baseline"] == "colocated x2"
    assert (out / "attainment_vs_rate.png").stat().st_size > 0
    with pytest.raises(SystemExit):  # another workload than the one recorded
        main(["bench", "compare", "--from", str(tmp_path / "results.json"), "--workload",
              "fixed:512:32", "--out", str(out)])
    for extra in (["--rates", "1,2"], ["--requests", "8"]):  # the recorded runs' are what
        with pytest.raises(SystemExit):  # there is
            main(["bench", "compare", "--from", str(tmp_path / "results.json"), "--workload",
                  "fixed:128:8", *extra, "--out", str(out)])
    for broken in ({"systems": []}, {"slo": {"ttft_s": 1.0}}):  # told, not a traceback
        (tmp_path / "broken.json").write_text(json.dumps(report | broken))
        with pytest.raises(SystemExit, match="2"):
            main(["bench", "compare", "--from", str(tmp_path / "broken.json"), "--workload",
                  "fixed:128:8", "--tpot-factor", "3", "--out", str(out)])


@pytest.mark.parametrize(("objectives", "slo"), [
    (["--ttft", "0.9", "--tpot", "0.07"], (0.9, 0.07)),
    (["--tpot-factor", "3"], (1.2, 0.075)),
    (["--ttft-factor", "4"], (0.8, 0.055))])
def test_a_recorded_comparison_is_scored_again_on_the_objectives_given(
        tmp_path: Path, objectives: list[str], slo: tuple[float, float]) -> None:
    """`--from` with --ttft/--tpot, or with a factor (times the unloaded latencies the run
    calibrated on: 0.2 s, 25 ms; the other objective as recorded: 1.2 s, 55 ms, which no
    default factor gives), scores what was measured on those objectives: the systems that
    missed the TPOT at 2 req/s (60 ms a token) meet 70 or 75, and a TTFT of 0.8 s (250 ms
    measured) changes nothing."""
    report = recorded_comparison(tmp_path / "results.json")
    report["slo"] = {"ttft_s": 1.2, "tpot_s": 0.055}
    (tmp_path / "results.json").write_text(json.dumps(report))
    out = tmp_path / "again"
    assert main(["bench", "compare", "--from", str(tmp_path / "results.json"), "--workload",
                 "fixed:128:8", "--out", str(out), *objectives]) == 0
    again = json.loads((out / "results.json").read_text())
    assert (again["slo"]["ttft_s"], again["slo"]["tpot_s"]) == pytest.approx(slo)
    for before, after in zip(report["systems"], again["systems"], strict=True):
        assert [r["attainment"] for r in after["runs"]] == (
            [1.0, 1.0] if slo[1] > 0.06 else [r["attainment"] for r in before["runs"]])
    assert [r["attainment"] for r in report["systems"][0]["runs"]] == [1.0, 0.0]


def test_a_stacks_found_prefixes_are_set_beside_the_prefix_cache_models(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Of a workload whose prompts share prefixes, `--simulate` sets the tokens each
    system's prefix caches found beside the model's, each instance a cache of its pool:
    one prefill instance's pool finds what one cache would; two colocated replicas sent
    requests at once split the conversations and find less."""
    spec = "chat:64:32:16:4:2"
    workload = parse_bench_workload(spec, Limits())
    items = workload.items[:6]
    one = cached_in([i.prefix for i in items], np.array([i.prompt_tokens for i in items]),
                    workload.block_tokens, None).tolist()
    report = recorded_comparison(tmp_path / "results.json")
    report |= {"workload": spec, "prefix_caching": True}
    for system in report["systems"]:
        for run in system["runs"]:
            for record, item, cached in zip(run["records"], items, one, strict=True):
                record |= {"prompt_tokens": item.prompt_tokens, "cached_tokens": cached,
                           "max_tokens": item.output_tokens}
                if run["rate"] == 2.0:  # all at once
                    record["arrival_s"] = record["sent_s"] = 0.0
    (tmp_path / "results.json").write_text(json.dumps(report))
    profile, slo = load_profile(shipped_cpu_profile(1)), SLO(1.0, 0.05)
    measured = recorded(report)
    disaggregated, colocated = (cache_fits(m, profile, workload, slo) for m in measured[:2])
    assert [(f.modelled, f.exact, f.requests) for f in disaggregated] == \
        [(f.measured, 6, 6) for f in disaggregated]
    assert colocated[0].modelled == colocated[0].measured  # far apart: one replica
    assert colocated[1].modelled < colocated[1].measured and colocated[1].exact < 6
    plain = parse_bench_workload("fixed:128:8", Limits())
    assert cache_fits(measured[0], profile, plain, slo) == []  # nothing shared

    out = tmp_path / "again"
    assert main(["bench", "compare", "--from", str(tmp_path / "results.json"), "--workload",
                 spec, "--out", str(out)]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "prefix caches of colocated x2, found measured/modelled at each rate" in printed
    again = json.loads((out / "results.json").read_text())
    assert [f["exact"] for f in again["systems"][0]["cache_model"]] == [6, 6]
