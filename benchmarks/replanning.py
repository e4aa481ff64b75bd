"""Online replanning: a workload whose prompts get much longer half-way, served with and
without the profiler and planner, side by side in one run.

    .venv/bin/python benchmarks/replanning.py [--before 40] [--after 100] [--after-gap 0.6]

Phase A: short prompts, longer outputs (decode-heavy); phase B: long prompts, two-token
outputs (prefill-heavy), faster than one prefill instance can take them. Both runs start at
1 prefill + 2 decode on a budget of 3 workers of 1 thread. Prints the time from the shift
(first phase-B request sent) to its detection, to the new plan, and to the new instances
serving, and SLO attainment before, during (until the new plan is applied) and after the
change, with and without replanning.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from redis import Redis

from distserve.bench.loadgen import Target, run_requests
from distserve.bench.results import RequestRecord
from distserve.bench.workload import BenchRequest
from services.launcher import Stack, StackConfig
from services.supervisor import free_port
from shared import subjects
from shared.metrics import SLO, attainment

SLO_USED = SLO(ttft_s=5.0, tpot_s=0.25)
ENV = {"DS_PLANNER_DEVICES": "3", "DS_PROFILER_WINDOW": "20", "DS_PROFILER_COOLDOWN_S": "10",
       "DS_PROFILER_CHECK_EVERY": "2", "DS_PLANNER_TTFT_S": str(SLO_USED.ttft_s),
       "DS_PLANNER_TPOT_S": str(SLO_USED.tpot_s)}


def workload(before: int, after: int, gap: float) -> list[BenchRequest]:
    out = [BenchRequest(i, 0.5 * i, list(range(1000 + i, 1016 + i)), 16, 24)
           for i in range(before)]
    start = 0.5 * before
    out += [BenchRequest(before + i, start + gap * i, list(range(2000 + i, 2384 + i)), 384, 2)
            for i in range(after)]
    return out


def share(records: list[RequestRecord]) -> str:
    if not records:
        return "-"
    return f"{attainment([r.ttft for r in records], [r.tpot for r in records], SLO_USED):.0%}" \
           f" of {len(records)}"


def run(planner: bool, requests: list[BenchRequest], before: int) -> dict[str, Any]:
    run_dir = Path(tempfile.mkdtemp(prefix="replanning-"))
    stack = Stack(StackConfig(port=free_port(), run_dir=run_dir, prefill=1, decode=2,
                              planner=planner, extra_env=ENV if planner else {}))
    stack.start()
    try:
        started = time.time()
        result = asyncio.run(run_requests(Target(stack.url, "smollm2-135m", timeout_s=600),
                                          requests, 1.0))
        redis = Redis.from_url(stack.env["DS_REDIS_URL"])
        history = [json.loads(h) for h in redis.lrange(subjects.PLAN_HISTORY_KEY, 0, -1)]
        plan = json.loads(redis.get(subjects.PLAN_KEY) or "null")
        view = json.loads(redis.get(subjects.PROFILER_KEY) or "null")
    finally:
        stack.stop()
    shift_at = started + next(r.sent_s for r in result.records if r.index == before
                              if r.sent_s is not None)
    out: dict[str, Any] = {"records": result.records, "shift_at": shift_at}
    if planner and view is not None:
        detected = next((s["at"] for s in view["shifts"]
                         if any("prompt" in r for r in s["reasons"])), None)
        made = next((p for p in reversed(history) if any("prompt" in r for r in p["reasons"])),
                    None)
        out |= {"detected_at": detected, "plan": made,
                "applied_at": plan.get("applied_at") if plan and made and
                plan["made_at"] == made["made_at"] else None}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=int, default=40, help="phase-A requests (2/s)")
    parser.add_argument("--after", type=int, default=100, help="phase-B requests")
    parser.add_argument("--after-gap", type=float, default=0.6,
                        help="seconds between phase-B requests (default 0.6: more than one "
                             "1-thread prefill instance sustains)")
    args = parser.parse_args()
    requests = workload(args.before, args.after, args.after_gap)
    results = {name: run(planner, requests, args.before)
               for name, planner in (("with replanning", True), ("static 1P+2D", False))}
    timed = results["with replanning"]
    shift = timed["shift_at"]
    print(f"SLO TTFT {SLO_USED.ttft_s}s, TPOT {SLO_USED.tpot_s}s; phase A {args.before} x "
          f"16/24 tokens at 2/s, phase B {args.after} x 384/2 tokens at "
          f"{1 / args.after_gap:.2f}/s")
    if timed.get("detected_at") and timed.get("plan"):
        plan = timed["plan"]
        print(f"shift -> detected {timed['detected_at'] - shift:.1f}s; detected -> plan "
              f"{plan['made_at'] - timed['detected_at']:.1f}s (search {plan['search_s']:.2f}s,"
              f" {plan['prefill']}P+{plan['decode']}D); plan -> new instances serving "
              f"{(timed['applied_at'] or float('nan')) - plan['made_at']:.1f}s")
    # "during": phase-B requests sent before the new plan was serving in the replanning run;
    # the same span after the shift is used for the static run
    window = (timed.get("applied_at") or float("inf")) - shift
    for name, r in results.items():
        records = r["records"]
        first_b = next(x.sent_s for x in records if x.index == args.before)
        before = [x for x in records if x.index < args.before]
        during = [x for x in records if x.index >= args.before and x.sent_s is not None
                  and x.sent_s - first_b < window]
        later = [x for x in records if x.index >= args.before and x not in during]
        failed = sum(not x.ok for x in records)
        print(f"{name:>16}: attainment before {share(before)}, during {share(during)}, after "
              f"{share(later)}; {failed} failed")

if __name__ == "__main__":
    main()
