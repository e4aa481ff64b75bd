"""Benchmark figures from hand-made request records (no server)."""

import math

import pytest

from distserve.bench.results import (
    RequestRecord,
    RunResult,
    attainment_at_scales,
    goodput,
    handoff_s,
    stage_breakdown,
    tightest_slo_scale,
)
from shared.metrics import SLO

SLO_1 = SLO(ttft_s=1.0, tpot_s=0.1)


def done(ttft: float, tpot: float, tokens: int = 11, sent: float = 0.0) -> RequestRecord:
    r = RequestRecord(0, sent, 10, tokens, sent_s=sent, first_token_s=sent + ttft,
                      last_token_s=sent + ttft + tpot * (tokens - 1), tokens=tokens)
    return r


def failed(error: str = "HTTP 503: no instance") -> RequestRecord:
    return RequestRecord(0, 0.0, 10, 11, sent_s=0.0, error=error)


def test_record_latencies_follow_the_paper_definitions() -> None:
    r = RequestRecord(0, 1.0, 10, 5, sent_s=1.0, first_token_s=1.5, last_token_s=2.3, tokens=5)
    assert r.ttft == pytest.approx(0.5)
    assert r.tpot == pytest.approx(0.2)  # (2.3 - 1.5) / (5 - 1)
    assert r.latency == pytest.approx(1.3)


def test_a_failed_or_timed_out_request_stays_in_the_totals_and_never_attains() -> None:
    # it even got tokens before it timed out: still not attaining
    late = RequestRecord(0, 0.0, 10, 11, sent_s=0.0, first_token_s=0.1, last_token_s=0.2,
                         tokens=3, error="timed out after 1s")
    run = RunResult(2.0, [done(0.5, 0.05), late, failed()], duration_s=4.0)
    s = run.summary(SLO_1, 0.9)
    assert (s["requests"], s["completed"], s["failed"]) == (3, 1, 2)
    assert s["attainment"] == pytest.approx(1 / 3)
    assert s["errors"] == ["HTTP 503: no instance", "timed out after 1s"]
    assert late.ttft is None and late.tpot is None
    assert s["throughput_rps"] == pytest.approx(0.25)


def test_summary_splits_attainment_by_objective() -> None:
    run = RunResult(1.0, [done(0.5, 0.05), done(2.0, 0.05), done(0.5, 0.2), done(0.2, 0.01)],
                    duration_s=10.0)
    s = run.summary(SLO_1, 0.9)
    assert s["attainment"] == 0.5
    assert s["ttft_attainment"] == 0.75 and s["tpot_attainment"] == 0.75
    assert s["ttft_s"]["p50"] == pytest.approx(0.5)


def test_tightest_slo_scale_is_the_target_quantile_of_per_request_scales() -> None:
    # per-request scales: max(ttft/1, tpot/0.1) = 0.5, 2.0, 2.0, 0.2, inf
    records = [done(0.5, 0.05), done(2.0, 0.05), done(0.5, 0.2), done(0.2, 0.01), failed()]
    assert tightest_slo_scale(records, SLO_1, 0.6) == pytest.approx(2.0)  # 3rd of 5
    assert tightest_slo_scale(records, SLO_1, 0.4) == pytest.approx(0.5)  # 2nd of 5
    assert tightest_slo_scale(records, SLO_1, 0.9) == math.inf  # needs the failed one
    assert attainment_at_scales(records, SLO_1, [0.1, 0.5, 1.0, 2.0, 100.0]) == \
        pytest.approx([0.0, 0.4, 0.4, 0.8, 0.8])


def test_goodput_interpolates_between_measured_rates() -> None:
    runs = [RunResult(1.0, [done(0.5, 0.05)] * 10, 10.0),
            RunResult(2.0, [done(0.5, 0.05)] * 9 + [failed()], 10.0),  # 90%: still meets
            RunResult(3.0, [done(0.5, 0.05)] * 7 + [failed()] * 3, 10.0)]  # 70%
    assert goodput(runs, SLO_1, 0.9) == pytest.approx(2.0)
    assert goodput(runs, SLO_1, 0.8) == pytest.approx(2.5)


def span(name: str, trace: str, start: str, end: str, **attributes: object) -> dict[str, object]:
    return {"name": name, "context": {"trace_id": trace}, "attributes": attributes,
            "start_time": f"2026-01-01T00:00:{start}Z", "end_time": f"2026-01-01T00:00:{end}Z"}


def test_breakdown_averages_each_stage_over_the_chosen_requests() -> None:
    spans = [span("request", "t1", "00.0", "09.0", request_id="a"),
             span("prefill queue", "t1", "00.0", "00.5"),
             span("prefill run", "t1", "00.5", "01.5"),
             span("kv transfer", "t1", "01.5", "01.6"),
             span("decode run", "t1", "01.6", "09.0"),
             span("request", "t2", "00.0", "05.0", request_id="b"),
             span("prefill queue", "t2", "00.0", "01.5"),
             span("request", "t3", "00.0", "05.0", request_id="other-run"),
             span("prefill queue", "t3", "00.0", "30.0")]
    b = stage_breakdown(spans, {"a", "b"})
    assert b["prefill queue"] == pytest.approx(1.0)  # (0.5 + 1.5) / 2; t3 not counted
    assert b["prefill run"] == pytest.approx(1.0)
    assert b["kv transfer"] == pytest.approx(0.1)
    assert "decode queue" not in b


def test_handoff_runs_from_the_first_token_to_the_decode_batch() -> None:
    """The median over the chosen requests of the gap between the prefill run's end and the
    decode run's start; requests of another run, or missing either span, do not count."""
    spans = [span("request", "t1", "00.0", "09.0", request_id="a"),
             span("prefill run", "t1", "00.5", "01.5"),
             span("decode queue", "t1", "01.51", "01.52"),
             span("kv transfer", "t1", "01.52", "01.54"),
             span("decode run", "t1", "01.54", "09.0"),
             span("request", "t2", "00.0", "09.0", request_id="b"),
             span("prefill run", "t2", "00.5", "01.0"),
             span("decode run", "t2", "01.1", "09.0"),
             span("request", "t3", "00.0", "09.0", request_id="c"),
             span("prefill run", "t3", "00.5", "01.0"),
             span("decode run", "t3", "01.02", "09.0"),
             span("request", "t4", "00.0", "05.0", request_id="d"),  # failed before decode
             span("prefill run", "t4", "00.5", "01.0"),
             span("request", "t5", "00.0", "05.0", request_id="other-run"),
             span("prefill run", "t5", "00.0", "01.0"),
             span("decode run", "t5", "04.0", "05.0")]
    assert handoff_s(spans, ["a", "b", "c", "d"]) == pytest.approx(0.04, abs=1e-6)  # 40, 100, 20 ms
    assert handoff_s(spans, ["d"]) is None
    assert handoff_s([], ["a"]) is None


def test_the_table_of_a_run_says_why_its_requests_failed() -> None:
    """The reasons come under the table, most frequent first, a few at most (a bench whose
    every request got a 404 printed only "failed 2" and NaNs)."""
    from rich.console import Console

    from distserve.bench.plots import Curve
    from distserve.commands.bench import MAX_ERRORS_SHOWN, _print_table

    errors = [f"HTTP 400: reason {i}" for i in range(MAX_ERRORS_SHOWN + 2)]
    records = [failed("HTTP 404: The model `x` does not exist")] * 3 + \
        [failed("HTTP 404: no route [/v1/x]")] * 2 + [failed(e) for e in errors] + \
        [done(0.1, 0.01)]
    console = Console(record=True, width=200)
    _print_table(console, Curve("s", 1, [RunResult(1.0, records, 10.0)]), SLO(1.0, 0.1), 0.9)
    text = console.export_text()
    assert "s: 3 requests failed: HTTP 404: The model `x` does not exist" in text
    assert "s: 2 requests failed: HTTP 404: no route [/v1/x]" in text  # the server's text
    assert text.count("request failed: HTTP 400") == MAX_ERRORS_SHOWN - 2
    assert f"s: {len(errors) - MAX_ERRORS_SHOWN + 2} other errors" in text
