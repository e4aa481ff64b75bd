"""How well a `bench compare` measurement repeats, beside how well the simulator follows it:
two runs of the same requests at the same rates and objectives (the second with the first's
`--rates`, `--ttft` and `--tpot`, same `--workload`, `--requests` and `--seed`), each
system's attainment measured in both, and simulated on the steps each run's stack ran
(`bench compare --simulate`'s live columns). Within how many points the measurement
repeats bounds how closely any simulator can be shown to follow it.

    .venv/bin/python benchmarks/repeatability.py FIRST/results.json SECOND/results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from distserve.bench.compare import Measured, recorded, simulate_live
from distserve.bench.workload import Limits, parse_bench_workload
from services.planner.profiles import load_profile, shipped_cpu_profile
from shared.host import cpu_description
from shared.metrics import SLO, attains

WITHIN = 5.0  # points


def attainments(report: dict[str, Any]) -> dict[tuple[str, float], tuple[float, float | None]]:
    """(system, rate) -> (measured, live-simulated) attainment, in points."""
    profile = load_profile(shipped_cpu_profile(int(report["threads_per_worker"]),
                                               cpu_description()))
    slo, workload = SLO(**report["slo"]), parse_bench_workload(report["workload"], Limits())
    out: dict[tuple[str, float], tuple[float, float | None]] = {}
    systems: list[Measured] = recorded(report)
    for measured in systems:
        for run, live in zip(measured.runs, simulate_live(measured, profile, workload, slo,
                                                           draws=0),
                             strict=True):
            met = 100 * statistics.fmean(attains(r.ttft, r.tpot, slo) for r in run.records)
            out[(measured.system.name, round(run.rate, 3))] = (
                met, None if live is None else 100 * live.result.attainment(slo))
    return out


def same_requests(first: dict[str, Any], second: dict[str, Any]) -> bool:
    return first["slo"] == second["slo"] and first["workload"] == second["workload"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path)
    args = parser.parse_args()
    reports = [json.loads(path.read_text()) for path in (args.first, args.second)]
    if not same_requests(*reports):
        raise SystemExit("the two runs differ in workload or objectives")
    first, second = (attainments(report) for report in reports)
    table = Table(title="attainment (%): measured twice, and each simulated on its own steps")
    for column in ("system", "rate", "first", "second", "|first - second|",
                   "live (first)", "live (second)"):
        table.add_column(column, justify="left" if column == "system" else "right")
    repeats: list[float] = []
    follows: list[float] = []
    for key in sorted(first.keys() & second.keys()):
        (a, live_a), (b, live_b) = first[key], second[key]
        repeats.append(abs(a - b))
        follows += [abs(live - met) for live, met in ((live_a, a), (live_b, b))
                    if live is not None]
        table.add_row(key[0], f"{key[1]:g}", f"{a:.0f}", f"{b:.0f}", f"{abs(a - b):.1f}",
                      "" if live_a is None else f"{live_a:.0f}",
                      "" if live_b is None else f"{live_b:.0f}")
    console = Console()
    console.print(table)
    if not repeats:
        raise SystemExit("no system ran at a rate both runs share")

    def summary(diffs: list[float]) -> str:
        within = sum(d <= WITHIN + 1e-9 for d in diffs)
        return (f"mean {statistics.fmean(diffs):.1f} points, largest {max(diffs):.1f}, "
                f"within {WITHIN:g}: {within} of {len(diffs)}")

    console.print(f"the measurement against itself: {summary(repeats)}")
    if follows:
        console.print(f"the live simulation against each measurement: {summary(follows)}")


if __name__ == "__main__":
    main()
