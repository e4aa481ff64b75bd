"""`distserve bench engine`: prefill and decode-step latency of this engine and of HF
transformers on the same weights, dtype and threads, plus the memory-bandwidth bound."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from distserve.commands.common import add_engine_args, engine_config
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.hf_reference import load_hf_reference
from shared.engine.request import SamplingParams

PREFILL_LENGTHS = [32, 64, 128, 256, 512, 1024]
DECODE_BATCHES = [1, 2, 4, 8, 16, 32, 64]


def register(sub: Any) -> None:
    p = sub.add_parser("engine", help="engine vs HF transformers latency, bandwidth bound",
                       description=__doc__)
    p.add_argument("--context", type=int, default=256, help="context of the decode steps")
    p.add_argument("--steps", type=int, default=8, help="decode steps timed per batch size")
    p.add_argument("--repeats", type=int, default=3, help="prefill runs per length (median)")
    p.add_argument("--lengths", type=int, nargs="+", default=PREFILL_LENGTHS)
    p.add_argument("--batches", type=int, nargs="+", default=DECODE_BATCHES)
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    p.add_argument("--json", action="store_true", help="print the results as JSON last")
    add_engine_args(p)
    p.set_defaults(parser=p, run=run, kv_cache_mb=2048)


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _prompt(length: int, vocab: int, salt: int) -> list[int]:
    gen = torch.Generator().manual_seed(length * 1000 + salt)
    return torch.randint(100, vocab - 100, (length,), generator=gen).tolist()


def engine_prefill_ms(engine: Engine, length: int, repeats: int) -> float:
    counter = iter(range(10**9))

    def once() -> None:
        engine.add_request(f"p{next(counter)}", _prompt(length, engine.model_config.vocab_size, 0),
                           SamplingParams(max_tokens=1, ignore_eos=True))
        engine.step()
    return _median_ms(once, repeats)


def engine_decode_ms(engine: Engine, batch: int, context: int, steps: int) -> float:
    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    ids = [engine.add_request(f"d{batch}-{i}", _prompt(context, vocab, i), params).request_id
           for i in range(batch)]
    while any(len(r.output_ids) == 0 for r in map(engine.scheduler.get, ids) if r):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    for rid in ids:
        engine.abort(rid)
    return statistics.median(times[1:])


@torch.inference_mode()
def hf_prefill_ms(hf: Any, length: int, vocab: int, repeats: int) -> float:
    ids = torch.tensor([_prompt(length, vocab, 0)])
    return _median_ms(lambda: hf(ids, use_cache=True, logits_to_keep=1), repeats)


@torch.inference_mode()
def hf_decode_ms(hf: Any, batch: int, context: int, vocab: int, steps: int) -> float:
    ids = torch.tensor([_prompt(context, vocab, i) for i in range(batch)])
    out = hf(ids, use_cache=True, logits_to_keep=1)
    cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        out = hf(token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])


def bandwidth_bound_ms(engine: Engine) -> tuple[float, float]:
    """(ms to read all weights once at the measured bandwidth, bandwidth in GB/s).
    The bandwidth is the better of streaming-read (sum) and copy (read+write bytes) over a
    buffer as large as the weights, with the same threads, so the bound is not loose."""
    cfg = engine.model_config
    element = torch.empty((), dtype=engine.runner.dtype).element_size()
    weight_bytes = (cfg.num_params() - cfg.vocab_size * cfg.hidden_size) * element
    weight_bytes += cfg.vocab_size * cfg.hidden_size * element  # the LM head reads it all
    src = torch.ones(weight_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    read_ms = _median_ms(lambda: src.sum(), 5)
    copy_ms = _median_ms(lambda: dst.copy_(src), 5)
    gbps = max(weight_bytes / read_ms, 2 * weight_bytes / copy_ms) / 1e6
    return weight_bytes / gbps / 1e6, gbps


def measure(config: EngineConfig, args: argparse.Namespace) -> dict[str, Any]:
    engine = Engine(config)
    vocab = engine.model_config.vocab_size
    results: dict[str, Any] = {"threads": torch.get_num_threads(),
                               "dtype": str(engine.runner.dtype)}
    results["prefill_ms"] = {n: engine_prefill_ms(engine, n, args.repeats) for n in args.lengths}
    results["decode_step_ms"] = {
        b: engine_decode_ms(engine, b, args.context, args.steps) for b in args.batches}
    results["bandwidth_bound_ms"], results["bandwidth_gbps"] = bandwidth_bound_ms(engine)
    if not args.no_hf:
        hf = load_hf_reference(config.model, engine.runner.dtype)
        results["hf_prefill_ms"] = {
            n: hf_prefill_ms(hf, n, vocab, args.repeats) for n in args.lengths}
        results["hf_decode_step_ms"] = {
            b: hf_decode_ms(hf, b, args.context, vocab, args.steps) for b in args.batches}
    return results


def _table(results: dict[str, Any], kind: str, key: str, label: str) -> Table:
    table = Table(title=f"{kind} latency (ms)")
    for column in (label, "engine", "HF", "HF / engine"):
        table.add_column(column, justify="right")
    hf = results.get(f"hf_{key}", {})
    for size, ms in results[key].items():
        other = hf.get(size)
        table.add_row(str(size), f"{ms:.2f}", "-" if other is None else f"{other:.2f}",
                      "-" if other is None else f"{other / ms:.2f}x")
    return table


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    config = engine_config(args).with_scheduler(max_batch_tokens=max(args.lengths),
                                                max_running=max(args.batches))
    results = measure(config, args)
    console = Console(stderr=args.json)
    console.print(_table(results, "Prefill", "prefill_ms", "prompt tokens"))
    console.print(_table(results, "Decode step", "decode_step_ms", f"batch (ctx {args.context})"))
    bound, step1 = results["bandwidth_bound_ms"], results["decode_step_ms"].get(1)
    console.print(f"bandwidth {results['bandwidth_gbps']:.1f} GB/s -> bound {bound:.2f} ms/step"
                  + ("" if step1 is None else f"; batch-1 step is {step1 / bound:.2f}x the bound")
                  + f"; threads {results['threads']}, {results['dtype']}")
    if args.json:
        print(json.dumps(results))
    return 0
