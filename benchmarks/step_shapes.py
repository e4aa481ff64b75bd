"""The engine's step times at the shapes the planner prices, next to the profile's and the
simulator's prices for the same steps (engine alone, one process):

- prefill steps of short prompts and one long one (the calibration's question: is the
  host's difference from the profile a scale or a fixed time a step?);
- chunked-prefill steps: `b` decodes alone, and `b` decodes beside one prompt chunk (how
  `ChunkedInstance` prices them, and how it used to: one prompt token per decode);
- a long prompt's chunks, each continuing it over the KV already cached (attention through a
  gather and an explicit mask, `model._prefill_attention`), against a whole prompt of the
  chunk's length (issue 13: the chunked replicas' prompt steps scatter 0.83-1.63x their fit).

    .venv/bin/python benchmarks/step_shapes.py [--threads 1] [--context 200] [--profile P]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch

from services.planner.latency import LatencyModel, chunk_terms
from services.planner.profiles import planner_profile
from shared.engine.config import EngineConfig, Role
from shared.engine.engine import Engine
from shared.engine.request import SamplingParams
from shared.host import cpu_description

ids = itertools.count()


def add(engine: Engine, length: int, max_tokens: int) -> str:
    n = next(ids)
    request_id, start = f"r{n}", 1000 + 37 * n % 20000
    engine.add_request(request_id, list(range(start, start + length)),
                       SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return request_id


def timed(engine: Engine) -> float:
    started = time.perf_counter()
    engine.step()
    return time.perf_counter() - started


def prefill_steps(threads: int, lat: LatencyModel, repeats: int) -> None:
    config = EngineConfig(threads=threads, kv_cache_bytes=256 << 20).with_scheduler(
        role=Role.PREFILL, max_batch_tokens=512, max_running=64)
    engine = Engine(config)
    print("prefill steps            measured   profile   measured - profile   ratio")
    for length, count in ((16, 1), (16, 2), (16, 3), (64, 1), (128, 1), (512, 1)):
        times = []
        for _ in range(repeats + 1):
            added = [add(engine, length, 1) for _ in range(count)]
            times.append(timed(engine))
            for request_id in added:
                engine.release(request_id)
        measured = statistics.median(times[1:])  # the first warms up
        predicted = lat.prefill_latency_s(length * count, length * length * count)
        print(f"  {count} x {length:>3} tokens        {measured * 1e3:7.1f}   "
              f"{predicted * 1e3:7.1f}   {(measured - predicted) * 1e3:+18.1f}   "
              f"{measured / predicted:5.2f}")


def chunked_steps(threads: int, lat: LatencyModel, context: int, repeats: int) -> None:
    config = EngineConfig(threads=threads, kv_cache_bytes=512 << 20).with_scheduler(
        role=Role.COLOCATED, max_batch_tokens=512, max_running=64, chunked_prefill=True)
    engine = Engine(config)
    print(f"chunked steps, decodes at a ~{context}-token context: measured / simulated now / "
          "as priced before (ms)")
    for batch in (1, 4, 8, 16):
        running = [add(engine, context, 400) for _ in range(batch)]
        while any((r := engine.scheduler.get(i)) is not None and r.num_computed < context
                   for i in running):
            engine.step()
        sum_ctx = sum(engine.scheduler.get(i).num_tokens for i in running)  # type: ignore[union-attr]
        alone = statistics.median(timed(engine) for _ in range(repeats))
        row = [f"  b={batch:<2} decodes only {alone * 1e3:5.0f} / "
               f"{lat.decode_step_s(batch, sum_ctx) * 1e3:4.0f} / "
               f"{lat.prefill_ms(batch, 0):4.0f}"]
        for chunk in (16, 64, 256):
            times = []
            for _ in range(repeats):
                add(engine, chunk, 1)
                times.append(timed(engine))
                while engine.scheduler.waiting or len(engine.scheduler.running) > batch:
                    engine.step()
            now = lat.prefill_ms(chunk, chunk * chunk) + lat.riding_ms(batch, sum_ctx)
            before = lat.prefill_ms(chunk + batch, chunk * chunk)
            row.append(f"+{chunk} {statistics.median(times) * 1e3:4.0f} / {now:4.0f} / "
                       f"{before:4.0f}")
        print(";  ".join(row), flush=True)
        for request_id in running:
            engine.abort(request_id)


def continued_chunks(threads: int, lat: LatencyModel, repeats: int,
                     prompt: int = 1024) -> None:
    print(f"a {prompt}-token prompt in chunks: measured / simulated / a whole prompt of the "
          "chunk's length measured (ms)")
    for budget in (128, 256, 512):
        config = EngineConfig(threads=threads, kv_cache_bytes=256 << 20).with_scheduler(
            role=Role.COLOCATED, max_batch_tokens=budget, chunked_prefill=True)
        engine = Engine(config)
        by_done: dict[int, list[float]] = {}
        for _ in range(repeats + 1):
            request = engine.scheduler.get(add(engine, prompt, 1))
            done = 0
            while request is not None and not request.status.finished:
                seconds = timed(engine)
                by_done.setdefault(done, []).append(seconds)
                done = request.num_computed
        whole = []
        for _ in range(repeats + 1):
            add(engine, budget, 1)
            whole.append(timed(engine))
            while engine.has_work():
                engine.step()
        alone = statistics.median(whole[1:]) * 1e3
        row = []
        for done, times in sorted(by_done.items()):
            n = min(budget, prompt - done)
            simulated = lat.prefill_ms(*chunk_terms([(n, done)]))
            row.append(f"+{n}@{done} {statistics.median(times[1:]) * 1e3:5.0f} / "
                       f"{simulated:5.0f}")
        print(f"  budget {budget:>3} (whole {budget}: {alone:5.0f}): " + ";  ".join(row),
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=200, help="the decodes' context")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", default="",
                        help="default: the shipped CPU profile of a CPU like this one")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # the profile measured on a CPU like this one where the project has one (as the planner)
    lat = planner_profile(args.profile, args.threads, cpu_description()).latency(1, 1)
    prefill_steps(args.threads, lat, args.repeats)
    chunked_steps(args.threads, lat, args.context, args.repeats)
    continued_chunks(args.threads, lat, args.repeats)


if __name__ == "__main__":
    main()
