"""A benchmark against one server: calibrate unloaded latencies, run the workload at each
rate, and assemble the report (figures, per-request records, breakdown)."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from distserve.bench.loadgen import Target, run_requests
from distserve.bench.results import (
    RunResult,
    goodput,
    met_everywhere,
    spanned_id,
    stage_breakdown,
)
from distserve.bench.steps import StepRecorder, steps_to_json
from distserve.bench.workload import BenchRequest, BenchWorkload
from shared.metrics import SLO

CALIBRATION_TOKENS = 16
HEARTBEAT_LAG_S = 1.0  # a worker heartbeats every 0.5 s; the recorder reads every 0.2 s


@dataclass(frozen=True)
class Unloaded:
    """Latencies of one request at a time: the reference the default SLOs scale."""

    ttft_s: float
    tpot_s: float
    prompt_tokens: int
    # a disaggregated stack's: how long the KV took from the prefill instance's first token
    # to the decode instance's running batch, inside those TPOTs (the probes' spans, median)
    handoff_s: float | None = None
    probes: tuple[str, ...] = ()  # the request ids of the probes the medians are of

    def slo(self, ttft_factor: float, tpot_factor: float) -> SLO:
        return SLO(ttft_factor * self.ttft_s, tpot_factor * self.tpot_s)


def calibrate(target: Target, workload: BenchWorkload, repeats: int = 5) -> Unloaded:
    """Unloaded TTFT and TPOT of the workload's median-length prompt: one warm-up, then
    `repeats` requests one at a time, medians. Five, not three: a stack's first seconds
    run slow, and on a shared host a busy moment can slow two probes running; the median of
    three once came out 16% over what the stack ran unloaded (a chunked replica's TPOT 28.2
    ms, its decode steps alone 23.9 ms and 23.4 ms a token when probed again), and a
    calibration that far off prices every step of every simulated rate that much slower.
    (Not the fastest few: the sweep runs at the host's typical speed, and a calibration on
    its best moments priced the steps 1.3-5.8 ms a token faster than the runs measured.)"""
    requests = workload.requests(1.0, max(64, len(workload.items)), seed=0)
    median = statistics.median_low(r.prompt_tokens for r in requests)
    probe = next(r for r in requests if r.prompt_tokens == median)
    probe = BenchRequest(0, 0.0, probe.prompt, probe.prompt_tokens, CALIBRATION_TOKENS)
    ttfts, tpots, ids = [], [], []
    for i in range(repeats + 1):
        run = asyncio.run(run_requests(target, [probe], 1.0))
        record = run.records[0]
        if record.ttft is None or record.tpot is None:
            raise RuntimeError(f"calibration request failed: {record.error}")
        if i:
            ttfts.append(record.ttft)
            tpots.append(record.tpot)
            ids.append(spanned_id(record.request_id or ""))
    return Unloaded(statistics.median(ttfts), statistics.median(tpots), median,
                    probes=tuple(ids))


def sweep(target: Target, workload: BenchWorkload, rates: Sequence[float], requests: int,
          seed: int, label: str = "", trace_dir: Path | None = None,
          more: Callable[[list[RunResult]], float | None] | None = None,
          recorder: StepRecorder | None = None) -> list[RunResult]:
    """The workload at each rate, one after the other, with a progress bar; then, while
    `more` names a next rate (given the runs so far), at that one too. With `recorder`,
    each run keeps the engine steps the workers ran during it."""
    runs: list[RunResult] = []
    if recorder is not None:  # not the steps before the first run (the calibration's probes)
        time.sleep(HEARTBEAT_LAG_S)
        recorder.take()
    with tqdm(total=requests * len(rates), desc=label or "requests", unit="req",
              dynamic_ncols=True) as bar:
        pending = list(rates)
        while pending:
            rate = pending.pop(0)
            bar.set_postfix(rate=f"{rate:g}/s")
            batch = workload.requests(rate, requests, seed)
            run = asyncio.run(run_requests(target, batch, rate, lambda _: bar.update()))
            if recorder is not None:
                time.sleep(HEARTBEAT_LAG_S)  # the run's last steps are in a heartbeat yet
                run.steps = recorder.take()
            runs.append(run)
            if not pending and more is not None and (extra := more(runs)) is not None:
                pending.append(extra)
                bar.total += requests
                bar.refresh()
    runs.sort(key=lambda run: run.rate)  # rates run below the grid came last
    if trace_dir is not None:
        time.sleep(1.5)  # the services flush their spans every 0.5 s
        spans = read_spans(trace_dir)
        for run in runs:
            ids = {spanned_id(r.request_id) for r in run.records if r.request_id}
            run.breakdown_s = stage_breakdown(spans, ids)
    return runs


def read_spans(trace_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for path in sorted(trace_dir.glob("traces-*.jsonl"))
            for line in path.read_text().splitlines() if line.strip()]


def system_report(name: str, devices: int, runs: Sequence[RunResult], slo: SLO,
                  target: float) -> dict[str, Any]:
    best = goodput(runs, slo, target)
    return {
        "name": name,
        "devices": devices,
        "goodput_rps": best,
        "per_device_goodput_rps": best / devices,
        "goodput_lower_bound": met_everywhere(runs, slo, target),
        "runs": [{**run.summary(slo, target),
                  "records": [r.to_json() for r in run.records]}
                 | ({"steps": steps_to_json(run.steps)} if run.steps else {}) for run in runs],
    }
