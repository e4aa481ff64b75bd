"""The profiler's calibration, replayed on the steps a `bench compare` run recorded: each
system's workers' steps (every rate in turn, as they ran) fed to a `Calibrator` as the
profiler hears them, a heartbeat of each worker every 0.5 s with its last 64 steps, fitted
after each; how often it would have asked the planner for a new plan
(`replan_reason`, at most once a `--cooldown`), how often a phase's basis changed, what a
fit cost and how many spans the timeline held. The 200-step windows the profiler had before
against the default two minutes. Near the profiler, not it: every worker is heard at the
same instants, without its `busy_since`, fitted at every heartbeat (the profiler: at most
once a second) and compared as fitted (the profiler: as last saved in Redis).

    .venv/bin/python benchmarks/calibration_replay.py runs/bench-.../results.json \\
        [--window 200 --window-s inf --cooldown 0]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from distserve.bench.compare import Measured, recorded
from services.planner.calibration import Calibration, Calibrator, replan_reason
from services.planner.latency import PHASES
from services.planner.profiles import Profile, load_profile, shipped_cpu_profile
from shared.host import cpu_description
from shared.state import StepSample

HEARD_EVERY_S = 0.5
HEARTBEAT_STEPS = 64


def replay(measured: Measured, profile: Profile, window: int, window_s: float,
           cooldown_s: float, ratio: float) -> dict[str, float]:
    steps: dict[str, list[StepSample]] = {}
    for run in measured.runs:
        for instance, samples in run.steps.items():
            steps.setdefault(instance, []).extend(samples)
    for samples in steps.values():
        samples.sort(key=lambda s: s.ended)
    calibrator = Calibrator(profile.latency(1, 1), window, window_s)
    start = min(s.ended - s.seconds for samples in steps.values() for s in samples)
    end = max(s.ended for samples in steps.values() for s in samples) + 1.0
    heard = dict.fromkeys(steps, 0)
    planned_on, replanned_at = Calibration(), -float("inf")
    last: Calibration | None = None
    fits = replans = changes = held = 0
    fitting_s = 0.0
    at = start + HEARD_EVERY_S
    while at <= end:
        for instance, samples in steps.items():
            n = heard[instance]
            while n < len(samples) and samples[n].ended <= at:
                n += 1
            heard[instance] = n
            calibrator.observe(instance, samples[max(0, n - HEARTBEAT_STEPS):n], machine="m",
                               heard_at=at, steps=samples[n - 1].step if n else 0)
        began = time.perf_counter()
        found = calibrator.calibration()
        fitting_s += time.perf_counter() - began
        fits += 1
        held = max(held, calibrator.timeline.held())
        if last is not None:
            changes += sum(getattr(found, f"{q}_basis") != getattr(last, f"{q}_basis")
                           for q in PHASES)
        if at - replanned_at >= cooldown_s and replan_reason(
                found, planned_on, ratio, calibrator.min_steps, profile.contention):
            replans, planned_on, replanned_at = replans + 1, found, at
        last = found
        at += HEARD_EVERY_S
    return {"minutes": (end - start) / 60, "fits": fits, "fit_ms": 1e3 * fitting_s / fits,
            "replans": replans, "basis changes": changes, "spans held": held}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="a results.json bench compare wrote")
    parser.add_argument("--window", type=int, default=Calibrator.window,
                        help="steps per phase at most")
    parser.add_argument("--window-s", type=float, default=Calibrator.window_s,
                        help="of the last this many seconds (inf: no limit)")
    parser.add_argument("--cooldown", type=float, default=30.0,
                        help="seconds between replans at least")
    parser.add_argument("--ratio", type=float, default=1.2,
                        help="DS_PROFILER_RECALIBRATE_RATIO")
    args = parser.parse_args()
    report = json.loads(args.results.read_text())
    profile = load_profile(shipped_cpu_profile(int(report["threads_per_worker"]),
                                               cpu_description()))
    table = Table(title=f"window {args.window} steps, {args.window_s:g} s; cooldown "
                        f"{args.cooldown:g} s")
    columns = ("minutes", "fits", "fit_ms", "replans", "basis changes", "spans held")
    table.add_column("system")
    for column in columns:
        table.add_column(column, justify="right")
    for measured in recorded(report):
        if not any(run.steps for run in measured.runs):
            continue
        row = replay(measured, profile, args.window, args.window_s, args.cooldown,
                     args.ratio)
        table.add_row(measured.system.name, *(f"{row[c]:.1f}" if isinstance(row[c], float)
                                              else str(row[c]) for c in columns))
    Console().print(table)


if __name__ == "__main__":
    main()
