"""How much one worker slows another on this host: the decode step time of one process, alone
and while a second process runs prefills back to back (and the reverse), 1 thread each.

    .venv/bin/python benchmarks/interference.py [--batch 2] [--prompt 512]

On a GPU, a prefill instance and a decode instance on separate GPUs do not share compute or
memory bandwidth. Two cores of one CPU socket share the last-level cache and the memory bus,
so "separate devices" here still interfere; this measures by how much, side by side.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable

import torch

from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.request import SamplingParams


def engine() -> Engine:
    torch.set_num_threads(1)
    return Engine(EngineConfig(threads=1))


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(1000, 20000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill_loop(n: int, stop: mp.Event, ready: mp.Event) -> None:  # type: ignore[type-arg]
    e = engine()
    ready.set()
    i = 0
    while not stop.is_set():
        e.generate([prompt(n, i)], SamplingParams(max_tokens=1, ignore_eos=True))
        i += 1


def decode_loop(batch: int, stop: mp.Event, ready: mp.Event) -> None:  # type: ignore[type-arg]
    e = engine()
    ready.set()
    while not stop.is_set():
        e.generate([prompt(64, i) for i in range(batch)],
                   SamplingParams(max_tokens=64, ignore_eos=True))


def decode_steps(e: Engine, batch: int, steps: int) -> list[float]:
    for i in range(batch):
        e.add_request(f"d{time.monotonic()}-{i}", prompt(64, i),
                      SamplingParams(max_tokens=steps + 2, ignore_eos=True))
    e.step()  # the prefill
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        e.step()
        times.append(time.perf_counter() - t)
    while e.has_work():
        e.step()
    return times


def prefill_times(e: Engine, n: int, count: int) -> list[float]:
    times = []
    for i in range(count):
        t = time.perf_counter()
        e.generate([prompt(n, 100 + i)], SamplingParams(max_tokens=1, ignore_eos=True))
        times.append(time.perf_counter() - t)
    return times


def with_neighbour(target: Callable[..., None], arg: int,
                   measure: Callable[[], list[float]]) -> list[float]:
    ctx = mp.get_context("spawn")
    stop, ready = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=target, args=(arg, stop, ready))
    proc.start()
    ready.wait()
    time.sleep(1.0)
    try:
        return measure()
    finally:
        stop.set()
        proc.join(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2, help="decode batch size")
    parser.add_argument("--prompt", type=int, default=512, help="prefill prompt tokens")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    e = engine()
    decode_steps(e, args.batch, 4)  # warm-up
    alone_d, busy_d, alone_p, busy_p = [], [], [], []
    for _ in range(args.rounds):  # interleaved, so drift hits both sides alike
        alone_d += decode_steps(e, args.batch, 20)
        busy_d += with_neighbour(prefill_loop, args.prompt,
                                 lambda: decode_steps(e, args.batch, 20))
        alone_p += prefill_times(e, args.prompt, 3)
        busy_p += with_neighbour(decode_loop, args.batch,
                                 lambda: prefill_times(e, args.prompt, 3))
    med = statistics.median
    print(f"decode step, batch {args.batch}: alone {1e3 * med(alone_d):.1f} ms, next to "
          f"prefills {1e3 * med(busy_d):.1f} ms ({med(busy_d) / med(alone_d):.2f}x)")
    print(f"prefill of {args.prompt} tokens: alone {1e3 * med(alone_p):.0f} ms, next to "
          f"decodes {1e3 * med(busy_p):.0f} ms ({med(busy_p) / med(alone_p):.2f}x)")


if __name__ == "__main__":
    main()
