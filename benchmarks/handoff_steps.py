"""Where a disaggregated request's KV handoff lands among the decode instance's steps, in a
recorded `bench compare` run: per request announced while the decode engine was mid-step,
whether its pull started on the announcement or when that step ended, and which step it
first ran in, against the simulator's two rules (`InstanceSpec.pulls_mid_step`): the pull's
blocks taken at once, beside the step (one rank on the CPU), or when the step under way
ends (the blocks taken by an engine call, which waits for it); either way the request joins
the first step that starts after its pull.

    .venv/bin/python benchmarks/handoff_steps.py LOGS RESULTS_JSON

LOGS: the disaggregated system's logs folder (`bench compare` prints "starting
disaggregated 1P+1D (logs in ...)"; its decode instance's spans are in
traces-decode-0.jsonl); RESULTS_JSON: that run's results.json (every run's steps, as the
workers heartbeated them).
"""

from __future__ import annotations

import argparse
import bisect
import json
from pathlib import Path
from typing import Any

from distserve.bench.results import span_bounds
from distserve.bench.runner import read_spans

WITHIN_S = 0.003  # a pull started on the announcement, or at the step's end


def decode_steps(results: dict[str, Any], system: str, instance: str) -> list[tuple[float, float]]:
    """(start, end) of every step `instance` ran, over all the system's runs, in order."""
    runs = next(s for s in results["systems"] if s["name"].startswith(system))["runs"]
    return sorted((ended - seconds, ended) for run in runs
                  for *_, seconds, ended in run["steps"].get(instance, []))


def handoffs(logs: Path, instance: str) -> list[tuple[float, float, float]]:
    """(announced, pull started, pulled) of each request the instance pulled and ran."""
    spans: dict[str, dict[str, tuple[float, float]]] = {}
    for span in read_spans(logs):
        if span["attributes"].get("instance") == instance:
            spans.setdefault(span["context"]["trace_id"], {})[span["name"]] = span_bounds(span)
    return [(s["decode queue"][0], s["kv transfer"][0], s["kv transfer"][1])
            for s in spans.values() if {"decode queue", "kv transfer", "decode run"} <= s.keys()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", type=Path)
    parser.add_argument("results", type=Path)
    parser.add_argument("--instance", default="decode-0")
    args = parser.parse_args()
    steps = decode_steps(json.loads(args.results.read_text()), "disaggregated", args.instance)
    starts = [start for start, _ in steps]

    def first_start_after(t: float) -> float | None:
        k = bisect.bisect_right(starts, t)
        return starts[k] if k < len(starts) else None

    mid_step = on_announcement = at_step_end = ran_as_mid_step = ran_as_after_step = 0
    ran_next = 0  # in the step right after the one it was announced in
    for announced, pull_start, pulled in handoffs(args.logs, args.instance):
        k = bisect.bisect_right(starts, announced) - 1
        if k < 0 or steps[k][1] <= announced:
            continue  # the engine idled: the pull starts at once under either rule
        step_end, ran = steps[k][1], first_start_after(pulled)
        mid_step += 1
        on_announcement += pull_start - announced <= WITHIN_S
        at_step_end += abs(pull_start - step_end) <= WITHIN_S
        ran_as_mid_step += first_start_after(announced + pulled - pull_start) == ran
        ran_as_after_step += first_start_after(step_end + pulled - pull_start) == ran
        ran_next += k + 1 < len(starts) and starts[k + 1] == ran
    ms = f"{1e3 * WITHIN_S:.0f} ms"
    print(f"requests announced while a decode step ran: {mid_step}")
    print(f"  pull started within {ms} of the announcement: {on_announcement}; "
          f"within {ms} of that step's end: {at_step_end}")
    print(f"  first ran in the step the rule names, with the blocks taken beside the step "
          f"(pulled on the announcement): {ran_as_mid_step}; after it (pulled at the step's "
          f"end): {ran_as_after_step}")
    print(f"  first ran in the step right after the one it was announced in: {ran_next}")


if __name__ == "__main__":
    main()
