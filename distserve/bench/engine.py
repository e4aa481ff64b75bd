"""What `distserve bench engine` measures (distserve/commands/bench_engine.py parses its
flags): prefill and decode-step latency of this engine and of HF transformers on the same
weights, dtype and threads, the memory-bandwidth bound, and with `--quality` how far
quantized weights move the predictions from float32's. Loads torch: the command imports it
only when it runs."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

from distserve.bench.workload import humaneval_prompts
from distserve.commands.common import engine_config
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine, RequestRejected
from shared.engine.hf_reference import hf_installed, load_hf_reference
from shared.engine.model_runner import load_model
from shared.engine.quality import Agreement, compare
from shared.engine.request import SamplingParams

# the bandwidth's buffers: the model's size, at most this (far past any cache; on a GPU, room
# beside an 8B model, its HF copy and the KV)
BANDWIDTH_BUFFER = 4 << 30


def _sync() -> None:
    """Waits for a GPU's queued work (a timed call returns before its kernels finish)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()


def _ms(fn: Callable[[], object]) -> float:
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    return (time.perf_counter() - start) * 1e3


def _prompt(length: int, vocab: int, salt: int) -> list[int]:
    gen = torch.Generator().manual_seed(length * 1000 + salt)
    return torch.randint(100, vocab - 100, (length,), generator=gen).tolist()


def rounds(fns: list[Callable[[], float]], repeats: int) -> list[list[float]]:
    """ms of each timed callable in each of `repeats` rounds, their runs interleaved (a, b,
    a, b, ...) so that drift in a shared machine's speed hits both alike. The first round is
    a warm-up, left out."""
    times: list[list[float]] = [[] for _ in fns]
    for i in range(repeats + 1):
        for fn, out in zip(fns, times, strict=True):
            ms = fn()
            if i:
                out.append(ms)
    return times


def side_by_side(fns: list[Callable[[], float]], repeats: int) -> list[float]:
    """Median ms of each timed callable over interleaved rounds (`rounds`)."""
    return [statistics.median(t) for t in rounds(fns, repeats)]


def ratio_range(hf: list[float], ours: list[float]) -> tuple[float, float]:
    """The lowest and highest of HF's time over the engine's within a round: runs of one round
    share the host's moment, so the spread says how far the host moved the ratio (a lent
    Xeon's batch-32 ratio read 1.82x one day and 2.17x another)."""
    ratios = [h / o for h, o in zip(hf, ours, strict=True)]
    return min(ratios), max(ratios)


class EnginePrefill:
    def __init__(self, engine: Engine, length: int) -> None:
        self.engine, self.length, self.count = engine, length, 0

    def __call__(self) -> float:
        self.count += 1
        prompt = _prompt(self.length, self.engine.model_config.vocab_size, 0)
        self.engine.add_request(f"p{self.length}-{self.count}", prompt,
                                SamplingParams(max_tokens=1, ignore_eos=True))
        return _ms(self.engine.step)


class EngineDecode:
    """A batch of requests at `context` tokens, all decoding; each call times a token each."""

    def __init__(self, engine: Engine, batch: int, context: int, steps: int) -> None:
        params = SamplingParams(max_tokens=steps + 4, ignore_eos=True)
        vocab = engine.model_config.vocab_size
        self.engine = engine
        self.requests = [engine.add_request(f"d{batch}-{i}", _prompt(context, vocab, i), params)
                         for i in range(batch)]
        while any(not r.output_ids for r in self.requests):
            engine.step()

    def __call__(self) -> float:
        """ms until every request has one more token: a step, or a micro-batch of a step a
        pipeline stage (each decodes its share of the batch)."""
        wanted = [len(r.output_ids) + 1 for r in self.requests]

        def advance() -> None:
            while any(len(r.output_ids) < n for r, n in zip(self.requests, wanted, strict=True)):
                self.engine.step()
        return _ms(advance)

    def close(self) -> None:
        for request in self.requests:
            self.engine.abort(request.request_id)


class HFPrefill:
    def __init__(self, hf: Any, length: int, vocab: int) -> None:
        self.hf, self.ids = hf, torch.tensor([_prompt(length, vocab, 0)], device=hf.device)

    @torch.inference_mode()
    def __call__(self) -> float:
        return _ms(lambda: self.hf(self.ids, use_cache=True, logits_to_keep=1))


class HFDecode:
    """HF's own cache (DynamicCache) grown by one token per call, like generate() does. The
    cache is `cache` from transformers 5.2x (`past_key_values`, deprecated there, before)."""

    @torch.inference_mode()
    def __init__(self, hf: Any, batch: int, context: int, vocab: int) -> None:
        self.hf = hf
        self.name = "cache" if "cache" in inspect.signature(hf.forward).parameters \
            else "past_key_values"
        ids = torch.tensor([_prompt(context, vocab, i) for i in range(batch)], device=hf.device)
        out = hf(ids, use_cache=True, logits_to_keep=1)
        self.cache, self.token = out[self.name], out.logits[:, -1].argmax(-1, keepdim=True)

    @torch.inference_mode()
    def __call__(self) -> float:
        def step() -> None:
            out = self.hf(self.token, use_cache=True, **{self.name: self.cache})
            self.token = out.logits[:, -1].argmax(-1, keepdim=True)
        return _ms(step)


@dataclasses.dataclass(frozen=True)
class Bound:
    """What a decode step at batch 1 is bound by, measured beside the step itself."""

    ms: float  # reading what a step reads once at `gbps`: the weights and the context's KV
    gbps: float
    step_ms: float  # the batch-1 step, timed in the same rounds
    kv_bytes: int  # of those bytes, the KV cache's


def bandwidth_bound(engine: Engine, context: int, rounds: int = 9) -> Bound:
    """The memory-bandwidth bound of a batch-1 decode step and the step, in the same
    interleaved rounds: a host's bandwidth can move by half within minutes, so a bound and a
    step timed apart say little of each other. The bandwidth is the better of streaming-read
    (sum) and copy (read+write bytes) over a buffer as large as the model's parameters (at
    most 4 GiB), with the same threads, on the model's device, so the bound is not loose;
    quantized weights are fewer bytes at the same bandwidth. A step reads its request's K/V
    as well as the weights: at `context` tokens those bytes count too (SmolLM2 at 512 tokens:
    24 MB beside 538 MB of weights)."""
    element = torch.empty((), dtype=engine.runner.dtype).element_size()
    buffer_bytes = min(engine.model_config.num_params() * element, BANDWIDTH_BUFFER)
    src = torch.ones(buffer_bytes // 4, dtype=torch.float32, device=engine.runner.device)
    dst = torch.empty_like(src)
    step = EngineDecode(engine, 1, context, 4 * rounds + 8)
    try:
        read_ms, copy_ms, step_ms = side_by_side(
            [lambda: _ms(src.sum), lambda: _ms(lambda: dst.copy_(src)), step], rounds)
    finally:
        step.close()
    gbps = max(buffer_bytes / read_ms, 2 * buffer_bytes / copy_ms) / 1e6
    kv_bytes = context * engine.model_config.kv_bytes_per_token(engine.runner.kv.data.itemsize)
    return Bound((engine.runner.model.weight_bytes() + kv_bytes) / gbps / 1e6, gbps, step_ms,
                 kv_bytes)


def measure(config: EngineConfig, args: argparse.Namespace) -> dict[str, Any]:
    with_hf = not args.no_hf and hf_installed()
    if not args.no_hf and not with_hf:
        Console(stderr=True).print("HF transformers is not installed (it comes with the test "
                                   "extras: pip install -e '.[test]'): timing the engine "
                                   "alone, as --no-hf does", markup=False)  # '[test]'
    engine = Engine(config)
    vocab = engine.model_config.vocab_size
    hf = None if not with_hf else load_hf_reference(config.model, engine.runner.dtype,
                                                   engine.runner.device, config.seed)
    results: dict[str, Any] = {"threads": torch.get_num_threads(),
                               "dtype": str(engine.runner.dtype), "weights": config.weights}
    for key in ("prefill_ms", "decode_step_ms", "hf_prefill_ms", "hf_decode_step_ms",
                "prefill_ratio_range", "decode_step_ratio_range"):
        results[key] = {}

    def record(kind: str, size: int, times: list[list[float]]) -> None:
        results[f"{kind}_ms"][size] = statistics.median(times[0])
        if len(times) > 1:  # HF beside
            results[f"hf_{kind}_ms"][size] = statistics.median(times[1])
            results[f"{kind}_ratio_range"][size] = ratio_range(times[1], times[0])

    for n in track(args.lengths, description="prefill", transient=True):
        fns: list[Callable[[], float]] = [EnginePrefill(engine, n)]
        fns += [] if hf is None else [HFPrefill(hf, n, vocab)]
        record("prefill", n, rounds(fns, args.repeats))
    for b in track(args.batches, description="decode", transient=True):
        ours = EngineDecode(engine, b, args.context, args.steps)
        fns = [ours] + ([] if hf is None else [HFDecode(hf, b, args.context, vocab)])
        record("decode_step", b, rounds(fns, args.steps))
        ours.close()
    bound = bandwidth_bound(engine, args.context)
    results |= {"bandwidth_bound_ms": bound.ms, "bandwidth_gbps": bound.gbps,
                "bound_step_ms": bound.step_ms, "bound_kv_bytes": bound.kv_bytes}
    if args.quality:
        results["quality"] = dataclasses.asdict(quality(engine, config, args.quality))
    return results


def quality(engine: Engine, config: EngineConfig, problems: int) -> Agreement:
    """The engine's model against the same model in float32 on the first `problems` HumanEval
    problems: each solution's tokens predicted with its prompt (and the solution so far) as
    context."""
    tokenizer = engine.runner.tokenizer
    if tokenizer is None:
        raise ValueError("--quality needs a model with a tokenizer (not a random shape)")
    reference = load_model(dataclasses.replace(config, weights="auto", dtype="float32"))[0]
    sequences, starts = [], []
    for prompt, solution in humaneval_prompts()[:problems]:
        context = tokenizer.encode(prompt, add_special_tokens=True)
        sequences.append(context + tokenizer.encode(solution))
        starts.append(len(context))
    return compare(engine.runner.model, reference, sequences, starts)


def _table(results: dict[str, Any], kind: str, key: str, label: str) -> Table:
    table = Table(title=f"{kind} latency (ms, medians of interleaved rounds)")
    for column in (label, "engine", "HF", "HF / engine", "within a round"):
        table.add_column(column, justify="right")
    hf = results.get(f"hf_{key}_ms", {})
    spread = results.get(f"{key}_ratio_range", {})
    for size, ms in results[f"{key}_ms"].items():
        other, (low, high) = hf.get(size), spread.get(size, (0.0, 0.0))
        table.add_row(str(size), f"{ms:.2f}", "-" if other is None else f"{other:.2f}",
                      "-" if other is None else f"{other / ms:.2f}x",
                      "-" if other is None else f"{low:.2f}-{high:.2f}x")
    return table


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    config = engine_config(args).with_scheduler(max_batch_tokens=max(args.lengths),
                                                max_running=max(args.batches))
    try:
        results = measure(config, args)
    except RequestRejected as e:
        parser.error(f"{e}: pass smaller --lengths or --context")
    except ValueError as e:  # an unknown model, a checkpoint the engine cannot read
        parser.error(str(e))
    console = Console(stderr=args.json)
    console.print(_table(results, "Prefill", "prefill", "prompt tokens"))
    console.print(_table(results, "Decode step", "decode_step", f"batch (ctx {args.context})"))
    bound, step1 = results["bandwidth_bound_ms"], results["bound_step_ms"]
    if "quality" in results:
        q = results["quality"]
        console.print(f"quality vs float32 weights ({q['positions']} HumanEval solution tokens, "
                      f"teacher-forced): top-1 agreement {q['top1']:.2%}, perplexity "
                      f"{q['perplexity']:.3f} vs {q['reference_perplexity']:.3f} "
                      f"({q['perplexity'] / q['reference_perplexity'] - 1:+.2%})")
    kv_mb = results["bound_kv_bytes"] / 1e6
    console.print(f"bandwidth {results['bandwidth_gbps']:.1f} GB/s -> bound {bound:.2f} ms/step "
                  f"(weights and {kv_mb:.0f} MB of KV at context {args.context}); "
                  f"the batch-1 step beside it {step1:.2f} ms, {step1 / bound:.2f}x the bound; "
                  f"threads {results['threads']}, {results['dtype']}, "
                  f"weights {results['weights']}")
    if args.json:
        print(json.dumps(results))
    return 0
