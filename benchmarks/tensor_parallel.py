"""Parallel instances on this machine: prefill latency and the decode step of each tp x pp,
side by side in one run, with the share of each step rank 0 spends in all-reduces (two a
layer; the wait for the slowest rank of its stage included).

    .venv/bin/python benchmarks/tensor_parallel.py        # qwen2.5-0.5b shape: 1x1, 2x1, 1x2
    .venv/bin/python benchmarks/tensor_parallel.py --model smollm2-135m --configs 1x1 3x1
    .venv/bin/python benchmarks/tensor_parallel.py --configs 1x1 1x2 1x2/seq  # pipelining

On the CPU the instance's threads (--threads) are split between its ranks, so a split on one
host measures what splitting the same cores costs: the all-reduces and smaller GEMMs (tp),
the hand-offs between stages (pp). A pipeline runs a micro-batch a stage at once: a decode
step of batch B is a round of micro-batches of B / pp each (timed until every request has a
token more), and `prefill N x L` times N prompts of the first length through the pipeline,
one prompt a micro-batch. A config ending in /seq runs the same pipeline a step at a time
(its stages one after another), to show what the micro-batches win. With --rank-threads N
each rank gets N threads of its own instead (an instance of r ranks: r x N), so more ranks
bring more cores, as devices do: on a host with the cores for it.

    .venv/bin/python benchmarks/tensor_parallel.py --model llama-3.2-1b --rank-threads 4 \
        --configs 1x1 2x1 4x1 1x2 --lengths 512"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from distserve.bench.engine import EngineDecode, EnginePrefill, _prompt
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.request import SamplingParams


def timed(engine: Engine, fn: Callable[[], float], repeats: int) -> tuple[float, float]:
    """Median ms of `fn` over `repeats` runs after a warm-up, and rank 0's median ms in
    all-reduces a run (0 at tp 1)."""
    fn()
    ranks = engine.runner.ranks
    step_ms, reduce_ms = [], []
    for _ in range(repeats):
        before = ranks.reduce_s if ranks else 0.0
        step_ms.append(fn())
        reduce_ms.append(((ranks.reduce_s if ranks else 0.0) - before) * 1e3)
    return statistics.median(step_ms), statistics.median(reduce_ms)


class PrefillStream:
    """`count` prompts of `length` tokens at once, a prompt a step (the step's token budget
    cut to one prompt): a pipeline runs them as micro-batches."""

    def __init__(self, engine: Engine, count: int, length: int) -> None:
        self.engine, self.count, self.length, self.calls = engine, count, length, 0
        engine.scheduler.config = dataclasses.replace(engine.scheduler.config,
                                                      max_batch_tokens=length)

    def __call__(self) -> float:
        self.calls += 1
        vocab = self.engine.model_config.vocab_size
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        requests = [self.engine.add_request(f"s{self.calls}-{i}", _prompt(self.length, vocab, i),
                                            params) for i in range(self.count)]
        started = time.perf_counter()
        while any(not r.output_ids for r in requests):
            self.engine.step()
        return (time.perf_counter() - started) * 1e3


def measure(config: EngineConfig, args: argparse.Namespace, one_at_a_time: bool,
            say: Callable[[str], None] = print) -> dict[str, Any]:
    """Each step's figures, each also said as soon as it is measured (a run cut short by a
    time limit keeps what it measured)."""
    started = time.perf_counter()
    engine = Engine(config)
    say(f"  loaded in {time.perf_counter() - started:.1f} s")
    if one_at_a_time:  # a step's stages one after another, no micro-batches under way
        engine.runner.depth = engine.scheduler.micro_batches = 1
    try:
        results: dict[str, Any] = {}

        def record(step: str, figures: tuple[float, float]) -> None:
            results[step] = figures
            say(f"  {step}: {figures[0]:.1f} ms, all-reduce {figures[1]:.1f} ms")

        for n in args.lengths:
            record(f"prefill {n}", timed(engine, EnginePrefill(engine, n), args.repeats))
        for b in args.batches:
            decode = EngineDecode(engine, b, args.context, args.steps + 1)
            record(f"decode b{b} ctx {args.context}", timed(engine, decode, args.steps))
            decode.close()
        if args.stream:
            length = args.lengths[0]
            record(f"prefill {args.stream} x {length}",
                   timed(engine, PrefillStream(engine, args.stream, length), args.repeats))
        return results
    finally:
        engine.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-0.5b",
                   help="a model or random Llama shape whose KV heads every --tp divides")
    p.add_argument("--configs", nargs="+", default=["1x1", "2x1", "1x2"], metavar="TPxPP",
                   help="instances to measure, tp x pp (the first is the baseline); "
                        "TPxPP/seq: the pipeline a step at a time")
    p.add_argument("--threads", type=int, default=2, help="the instance's, split by its ranks")
    p.add_argument("--rank-threads", type=int, default=0, metavar="N",
                   help="instead, N threads a rank: an instance of more ranks has more cores")
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3, help="prefill runs (median)")
    p.add_argument("--steps", type=int, default=8, help="decode steps (median)")
    p.add_argument("--stream", type=int, default=4, metavar="N",
                   help="prompts of the first length run at once, one a micro-batch (0: none)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()
    console = Console()
    figures, threads_of = {}, {}
    for name in args.configs:
        shape, _, how = name.partition("/")
        tp, pp = (int(n) for n in shape.split("x"))
        console.print(f"tp {tp} x pp {pp}{' a step at a time' if how == 'seq' else ''} ...")
        threads = args.rank_threads * tp * pp if args.rank_threads else args.threads
        threads_of[name] = threads
        config = EngineConfig(model=args.model, tp=tp, pp=pp, threads=threads,
                              kv_cache_bytes=2 << 30).with_scheduler(
            max_batch_tokens=max(args.lengths), max_running=max(args.batches))
        figures[name] = measure(config, args, how == "seq", console.print)
    base = args.configs[0]
    cores = f"{args.rank_threads} threads a rank" if args.rank_threads else \
        f"{args.threads} threads an instance"
    table = Table(title=f"{args.model}, {cores} (ms; tp x pp)")
    table.add_column("step")
    for name in args.configs:
        table.add_column(name, justify="right")
        if name != base:
            table.add_column(f"{base} / {name}", justify="right")
            table.add_column(f"{name} all-reduce", justify="right")
    for step in figures[base]:
        row = [step]
        for name in args.configs:
            ms, reduce_ms = figures[name][step]
            row.append(f"{ms:.1f}")
            if name != base:
                row += [f"{figures[base][step][0] / ms:.2f}x",
                        f"{reduce_ms:.1f} ({reduce_ms / ms:.0%})"]
        table.add_row(*row)
    console.print(table)
    if args.json:
        args.json.write_text(json.dumps({
            "model": args.model, "rank_threads": args.rank_threads,
            # each configuration's threads, all its ranks together
            "threads": threads_of,
            "figures": {name: {step: {"ms": ms, "all_reduce_ms": r}
                               for step, (ms, r) in f.items()}
                        for name, f in figures.items()}}, indent=1))


if __name__ == "__main__":
    main()
