"""Where each worker's time goes under load: a 1 prefill + 1 decode stack serves a
prompt-heavy workload, and the engine-loop counters the workers heartbeat (`ds_engine_*` on
the gateway's /metrics) give steps, mean requests per step, seconds per step (and of them the
engine thread's on a CPU and runnable waiting for one) and seconds handling each step's
outputs.

    .venv/bin/python benchmarks/engine_loop.py [--rate 0.6] [--requests 32]

Then the engine alone, in this process with the workers' threads, times the same steps: a
prompt of the workload's length, and decode steps at batch 1 and 2 at the context the
stack's requests decode at (a context the profile's 64-token decode points miss by ~10%).
The decode instance's ms per step is compared with the alone figure at its mean batch
(linear in the batch through the batch-1 and batch-2 figures), the prefill instance's with
the alone prefill.
"""

from __future__ import annotations

import argparse
import re
import statistics
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
    parser.add_argument("--workload", default="fixed:512:32", help="fixed:PROMPT:OUTPUT")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="engine-loop-"))
    stack = Stack(StackConfig(port=free_port(), run_dir=run_dir, threads=args.threads))
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
    alone = engine_alone(args.workload, args.threads)
    print(f"engine alone: prefill {alone['prefill']:.1f} ms, decode {alone[1]:.1f} ms at batch "
          f"1 and {alone[2]:.1f} ms at batch 2 (medians)")
    for instance in sorted({i for i, _ in after}):
        d = {name: value - before.get((i, name), 0.0)
             for (i, name), value in after.items() if i == instance}
        steps = d["ds_engine_steps_total"]
        stepping = d["ds_engine_step_seconds_total"]
        handling = d["ds_engine_outputs_seconds_total"]
        if steps:
            batch = d["ds_engine_batched_requests_total"] / steps
            same = alone["prefill"] if instance.startswith("prefill") else \
                alone[1] + (alone[2] - alone[1]) * (batch - 1)
            print(f"{instance}: {1e3 * stepping / steps:.1f} ms per step in the stack vs "
                  f"{same:.1f} ms alone at the same batch ({stepping / steps * 1e3 / same:.3f}x)")
            cpu = d["ds_engine_step_cpu_seconds_total"]
            queued = d["ds_engine_step_queued_seconds_total"]
            print(f"{instance}: of each step's {1e3 * stepping / steps:.1f} ms, the engine thread "
                  f"ran {1e3 * cpu / steps:.1f} ms on a CPU, waited {1e3 * queued / steps:.1f} ms "
                  f"runnable for one, and {1e3 * (stepping - cpu - queued) / steps:.1f} ms "
                  "elsewhere (blocked, the thread handoff, the intra-op threads)")
            print(f"{instance}: {steps:.0f} steps, {batch:.2f} "
                  f"requests per step, {1e3 * stepping / steps:.1f} ms per step, "
                  f"{1e3 * handling / steps:.2f} ms handling its outputs; busy "
                  f"{(stepping + handling) / wall:.0%} of {wall:.0f} s")


def engine_alone(workload: str, threads: int, steps: int = 30) -> dict[str | int, float]:
    """Median ms of a prefill of the workload's prompt, and of decode steps at batch 1 and 2
    from the middle of the output on (the context the stack's requests decode at)."""
    import torch

    from shared.engine.config import EngineConfig
    from shared.engine.engine import Engine
    from shared.engine.request import SamplingParams

    _, prompt, output = workload.split(":")
    n, out = int(prompt), int(output)
    torch.set_num_threads(threads)
    engine = Engine(EngineConfig(threads=threads))
    ids = torch.Generator().manual_seed(0)

    def add(name: str, max_tokens: int) -> None:
        engine.add_request(name, torch.randint(1000, 20000, (n,), generator=ids).tolist(),
                           SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    def timed() -> float:
        started = time.perf_counter()
        engine.step()
        return 1e3 * (time.perf_counter() - started)

    result: dict[str | int, float] = {}
    prefills = []
    for i in range(3):
        add(f"p{i}", 1)
        prefills.append(timed())
        while engine.has_work():
            engine.step()
    result["prefill"] = statistics.median(prefills)
    for batch in (1, 2):
        for i in range(batch):
            add(f"d{batch}-{i}", out // 2 + steps + 1)
        while engine.last_shape is None or engine.last_shape.batch != batch:
            engine.step()  # the prompts, then decodes at the batch
        for _ in range(out // 2 - 1):
            engine.step()  # on to the middle of the output
        result[batch] = statistics.median(timed() for _ in range(steps))
        while engine.has_work():
            engine.step()
    return result


if __name__ == "__main__":
    main()
