"""Where each worker's time goes under load: a 1 prefill + 1 decode stack serves a
prompt-heavy workload, and the engine-loop counters the workers heartbeat (`ds_engine_*` on
the gateway's /metrics) give steps, mean requests per step, seconds per step and seconds
handling each step's outputs.

    .venv/bin/python benchmarks/engine_loop.py [--rate 0.6] [--requests 32]

Compare the seconds per step with the engine alone in-process at the same batch
(`distserve bench engine`, or benchmarks/interference.py) to see what serving adds.
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from pathlib import Path

import httpx

from distserve.cli import main as distserve
from services.launcher import Stack, StackConfig
from services.supervisor import free_port

PATTERN = re.compile(r'^(ds_engine_\w+)\{instance="([^"]+)",role="[^"]+"\} (\S+)$', re.M)


def counters(url: str) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(m.group(2), m.group(1)): float(m.group(3)) for m in PATTERN.finditer(text)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=0.6)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--workload", default="fixed:512:32")
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="engine-loop-"))
    stack = Stack(StackConfig(port=free_port(), run_dir=run_dir))
    stack.start()
    try:
        before, started = counters(stack.url), time.time()
        distserve(["bench", "--url", stack.url, "--workload", args.workload, "--rates",
                   str(args.rate), "--requests", str(args.requests), "--ttft", "60",
                   "--tpot", "5", "--out", str(run_dir / "bench")])
        time.sleep(1.5)  # one more heartbeat
        after, wall = counters(stack.url), time.time() - started
    finally:
        stack.stop()
    for instance in sorted({i for i, _ in after}):
        d = {name: value - before.get((i, name), 0.0)
             for (i, name), value in after.items() if i == instance}
        steps = d["ds_engine_steps"]
        stepping, handling = d["ds_engine_step_seconds"], d["ds_engine_outputs_seconds"]
        if steps:
            print(f"{instance}: {steps:.0f} steps, {d['ds_engine_batched_requests'] / steps:.2f} "
                  f"requests per step, {1e3 * stepping / steps:.1f} ms per step, "
                  f"{1e3 * handling / steps:.2f} ms handling its outputs; busy "
                  f"{(stepping + handling) / wall:.0%} of {wall:.0f} s")


if __name__ == "__main__":
    main()
