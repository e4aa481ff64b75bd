"""Whether a prefill queue's wait comes from its steps' times or from their order: for each
rate of a recorded `bench compare` run, the disaggregated system's prefill instance's
measured wait (its recorded steps, first come first served, against the requests'
arrivals), beside the wait the same arrivals meet with the very same step durations in the
order they ran, in shuffled orders, and all at their median; with the durations' spread
and lag-1 autocorrelation, and the TTFT attainment each gives. A simulator that prices
each step from a fitted model (with or without noise drawn step by step) meets the
shuffled or the median figure; where the order waits longer than the shuffled ones, slow
steps came in spells, and near the instance's capacity that alone moves the attainment.

    .venv/bin/python benchmarks/queue_replay.py runs/bench-<time>/results.json

Only a system with one prefill instance whose steps each prefilled one prompt (a workload
of fixed prompts of max_batch_tokens, such as fixed:512:32) is replayed: there the steps
are the requests, in order.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ORDERS = 200  # shuffled orders a rate


def fifo_waits(arrivals: Sequence[float], durations: Sequence[float]) -> list[float]:
    """Each request's wait for one server that serves them in order, each for its duration."""
    free, waits = -float("inf"), []
    for arrival, duration in zip(arrivals, durations, strict=True):
        start = max(arrival, free)
        waits.append(start - arrival)
        free = start + duration
    return waits


def lag1(xs: Sequence[float]) -> float:
    """Lag-1 autocorrelation: how much a step's time follows the one before it."""
    mean = statistics.fmean(xs)
    spread = sum((x - mean) ** 2 for x in xs)
    return sum((a - mean) * (b - mean) for a, b in itertools.pairwise(xs)) / spread \
        if spread else 0.0


def replay(run: dict[str, Any], ttft_s: float, seed: int = 0) -> dict[str, float] | None:
    """One rate's waits (ms) and TTFT attainments (%), measured and replayed; None where the
    run is not one prefill instance's one-prompt steps."""
    prefills = [steps for name, steps in (run.get("steps") or {}).items()
                if name.startswith("prefill")]
    records = sorted(run["records"], key=lambda r: r["arrival_s"])
    if len(prefills) != 1 or len(prefills[0]) != len(records) or \
            any(len(step[1]) != 1 for step in prefills[0]):
        return None
    # a step sample: (step, prompt lengths, ..., duration s, ended at, wall clock)
    durations = [step[4] for step in prefills[0]]
    starts = [step[5] - step[4] for step in prefills[0]]
    zero = starts[0] - records[0]["sent_s"]  # the first request started on arrival
    arrivals = [zero + r["arrival_s"] for r in records]
    measured = [start - arrival for start, arrival in zip(starts, arrivals, strict=True)]
    # what a request's TTFT has beyond its wait and its step: its dispatch and first token
    rest = statistics.median(r["ttft_s"] - w - d for r, w, d in
                             zip(records, measured, durations, strict=True))

    def attained(waits: Sequence[float]) -> float:
        return 100 * statistics.fmean(w + d + rest <= ttft_s
                                      for w, d in zip(waits, durations, strict=True))

    rng = random.Random(seed)
    shuffled_waits, shuffled_met = [], []
    for _ in range(ORDERS):
        order = rng.sample(durations, len(durations))
        waits = fifo_waits(arrivals, order)
        shuffled_waits.append(statistics.fmean(waits))
        shuffled_met.append(100 * statistics.fmean(
            w + d + rest <= ttft_s for w, d in zip(waits, order, strict=True)))
    in_order = fifo_waits(arrivals, durations)
    median = fifo_waits(arrivals, [statistics.median(durations)] * len(durations))
    deciles = statistics.quantiles(shuffled_waits, n=10)
    return {
        "measured_ms": 1e3 * statistics.fmean(measured),
        "in_order_ms": 1e3 * statistics.fmean(in_order),
        "shuffled_ms": 1e3 * statistics.fmean(shuffled_waits),
        "shuffled_p10_ms": 1e3 * deciles[0], "shuffled_p90_ms": 1e3 * deciles[-1],
        "median_ms": 1e3 * statistics.fmean(median),
        "lag1": lag1(durations),
        "cv": statistics.pstdev(durations) / statistics.fmean(durations),
        "busy": sum(durations) / (arrivals[-1] - arrivals[0] + durations[-1]),
        "measured_met": 100 * statistics.fmean(r["ttft_s"] <= ttft_s for r in records),
        "in_order_met": attained(in_order),
        "shuffled_met": statistics.fmean(shuffled_met),
        "median_met": 100 * statistics.fmean(
            w + statistics.median(durations) + rest <= ttft_s for w in median),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="a bench compare run's results.json")
    parser.add_argument("--seed", type=int, default=0, help="of the shuffled orders")
    args = parser.parse_args()
    report = json.loads(args.results.read_text())
    ttft_s = report["slo"]["ttft_s"]
    table = Table(title=f"prefill wait (mean ms a request) and TTFT attainment (%, objective "
                        f"{ttft_s:.2f} s): measured, and the same steps replayed in order, "
                        f"in {ORDERS} shuffled orders, all at their median")
    for column in ("system", "rate", "busy", "steps cv", "lag-1", "measured", "in order",
                   "shuffled (p10-p90)", "median", "TTFT met: measured / in order / "
                   "shuffled / median"):
        table.add_column(column, justify="left" if column == "system" else "right")
    rows = 0
    for system in report["systems"]:
        for run in system["runs"]:
            got = replay(run, ttft_s, args.seed)
            if got is None:
                continue
            rows += 1
            table.add_row(
                system["name"], f"{run['rate']:g}", f"{got['busy']:.2f}", f"{got['cv']:.3f}",
                f"{got['lag1']:.2f}", f"{got['measured_ms']:,.0f}", f"{got['in_order_ms']:,.0f}",
                f"{got['shuffled_ms']:,.0f} ({got['shuffled_p10_ms']:,.0f}-"
                f"{got['shuffled_p90_ms']:,.0f})", f"{got['median_ms']:,.0f}",
                f"{got['measured_met']:.0f} / {got['in_order_met']:.0f} / "
                f"{got['shuffled_met']:.0f} / {got['median_met']:.0f}")
    if not rows:
        raise SystemExit("no run of one prefill instance with one prompt a step (a workload "
                         "such as fixed:512:32 on a disaggregated system)")
    Console().print(table)


if __name__ == "__main__":
    main()
