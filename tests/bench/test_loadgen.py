"""`distserve bench` against a real stack (1 prefill + 1 decode processes, NATS, Valkey), and
against servers that fail: every request is accounted for."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from distserve.bench.compare import RateGrid
from distserve.bench.loadgen import Target
from distserve.bench.runner import Unloaded, calibrate, sweep, system_report
from distserve.bench.steps import StepRecorder
from distserve.bench.workload import Limits, parse_bench_workload
from distserve.cli import main
from services.launcher import Stack
from services.supervisor import free_port
from shared.metrics import SLO
from tests.services.conftest import start_stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("bench-stack"))
    yield s
    s.stop()


def bench(url: str, out: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    code = main(["bench", "--url", url, "--workload", "fixed:40:6", "--requests", "6",
                 "--out", str(out), *extra])
    return code, json.loads((out / "results.json").read_text())


def test_every_request_completes_with_figures_plots_and_breakdown(stack: Stack,
                                                                  tmp_path: Path) -> None:
    code, report = bench(stack.url, tmp_path, "--rates", "1,4", "--ttft", "30", "--tpot", "5",
                         "--traces", str(stack.run_dir))
    assert code == 0
    (system,) = report["systems"]
    assert [run["rate"] for run in system["runs"]] == [1.0, 4.0]
    for run in system["runs"]:
        assert run["requests"] == run["completed"] == 6 and run["failed"] == 0
        assert run["attainment"] == 1.0  # objectives far beyond this load's latencies
        records = run["records"]
        assert sorted(r["index"] for r in records) == list(range(6))
        assert all(r["tokens"] == 6 and r["ttft_s"] > 0 and r["tpot_s"] > 0 for r in records)
        assert all(r["request_id"].startswith("cmpl-") for r in records)
        # the traces give every stage of a disaggregated request
        assert set(run["breakdown_s"]) == {"prefill queue", "prefill run", "kv transfer",
                                           "decode queue", "decode run"}
        assert run["breakdown_s"]["decode run"] > 0
    assert system["goodput_rps"] == 4.0  # met at every measured rate
    for name in ("attainment_vs_rate.png", "attainment_vs_slo_scale.png", "breakdown.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_a_sweep_goes_past_its_grid_until_the_goodput_is_bracketed(stack: Stack) -> None:
    """Objectives far beyond this load's latencies: every rate meets them, so the sweep
    raises the rate (1.5x) as often as the grid allows and the goodput stays a lower
    bound, said so in the report."""
    workload = parse_bench_workload("fixed:40:4", Limits())
    slo = SLO(30.0, 5.0)
    grid = RateGrid((), 4, lambda _: slo, 0.9, extend=2, rates=[2.0])
    target = Target(stack.url, stack.config.model, timeout_s=120)
    recorder = StepRecorder(stack.env["DS_REDIS_URL"])
    try:
        calibrate(target, workload)  # probes: their steps are no run's
        runs = sweep(target, workload, grid.start(Unloaded(0.1, 0.01, 40)), 4, 0,
                     more=grid.more, recorder=recorder)
    finally:
        recorder.close()
    assert [run.rate for run in runs] == [2.0, 3.0, 4.5]
    assert all(len(run.records) == 4 and all(r.ok for r in run.records) and
               run.attainment(slo) == 1.0 for run in runs)
    # each run kept the engine steps the workers ran during it, each once: every prompt
    # prefilled once, and three decode steps a request (its first token is the prefill's)
    for run in runs:
        samples = [s for steps in run.steps.values() for s in steps]
        assert sum(sum(s.prompts) for s in samples) == 4 * 40
        assert sum(s.batch for s in samples) == 4 * 3
        assert all(s.seconds > 0 and s.ended > 0 for s in samples)
    report = system_report("stack", 2, runs, slo, 0.9)
    assert report["goodput_rps"] == 4.5 and report["goodput_lower_bound"]


def test_a_traces_shared_prefixes_are_found_in_the_stacks_caches_as_predicted(
        stack: Stack, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Mooncake trace's hash_ids become prompts that share those blocks' tokens: the
    stack's prefix caches find what the workload's model of an unlimited cache predicts, and
    each request's record says how much (from its usage)."""
    trace = tmp_path / "trace.jsonl"
    rows = [(800, [0, 1]), (800, [0, 1]), (800, [0, 2]), (800, [3, 4])]
    trace.write_text("".join(json.dumps({"timestamp": 1000 * i, "input_length": n,
                                         "output_length": 8, "hash_ids": ids}) + "\n"
                             for i, (n, ids) in enumerate(rows)))
    spec = f"mooncake:{trace}"
    out = tmp_path / "run"
    monkeypatch.setenv("COLUMNS", "200")  # the table's columns unwrapped

    def found(*args: str) -> tuple[dict[str, Any], list[int]]:
        """One rate's run of `args` (SLOs far beyond its latencies): its report and each
        request's tokens found cached."""
        code = main(["bench", "--url", stack.url, "--rates", "0.25", "--ttft", "30",
                     "--tpot", "5", "--out", str(out), *args])
        assert code == 0
        (run,) = json.loads((out / "results.json").read_text())["systems"][0]["runs"]
        return run, [r["cached_tokens"] for r in sorted(run["records"],
                                                        key=lambda r: r["index"])]

    run, cached = found("--workload", spec, "--length-scale", "0.125", "--requests", "4")
    predicted = parse_bench_workload(spec, Limits(length_scale=0.125)).as_workload(
        None).lengths
    assert cached == predicted.cached.tolist() == [0, 96, 64, 0]  # type: ignore[union-attr]
    assert run["cached_share"] == pytest.approx(160 / 400)
    assert "40.0%" in capsys.readouterr().out  # the table's `cached` column
    # conversations: two at once, of three turns, after a 40-token system prompt; arrivals
    # nearly even, 4 s apart (a turn is prefilled before the next comes, as a conversation's
    # are, on a busy host too)
    chat = "chat:40:20:4:3:2"
    _, cached = found("--workload", chat, "--requests", "6", "--cv", "0.1")
    predicted = parse_bench_workload(chat, Limits()).as_workload(None).lengths
    assert cached == predicted.cached[:6].tolist() == [0, 32, 48, 48, 80, 80]  # type: ignore[index]


def test_timed_out_requests_count_as_failed_not_lost(stack: Stack, tmp_path: Path) -> None:
    code, report = bench(stack.url, tmp_path, "--rates", "2", "--ttft", "30", "--tpot", "5",
                         "--timeout", "0.05")
    assert code == 1
    (run,) = report["systems"][0]["runs"]
    assert run["requests"] == 6 and run["failed"] == 6 and run["attainment"] == 0.0
    assert run["errors"] == ["timed out after 0.05s"]


def test_a_server_that_is_down_fails_every_request_visibly(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    code, report = bench(url, tmp_path, "--model", "m", "--rates", "5", "--ttft", "1",
                         "--tpot", "1")
    assert code == 1
    (run,) = report["systems"][0]["runs"]
    assert (run["requests"], run["completed"], run["failed"]) == (6, 0, 6)
    assert all(r["error"].startswith("ConnectError") for r in run["records"])
    assert report["systems"][0]["goodput_rps"] == 0.0


def test_bad_arguments_get_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    for args, message in ((["--rates", "fast"], "comma-separated numbers"),
                          (["--ttft", "1"], "both --ttft and --tpot"),
                          (["--workload", "nope"], "unknown workload")):
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", "--url", "http://127.0.0.1:1", *args])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
