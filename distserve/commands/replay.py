"""`distserve replay TRACE`: send a trace's requests at their recorded times (divided by
--speed) to an OpenAI-compatible server, and report what became of each one."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from tqdm import tqdm

from distserve.bench.loadgen import Target, run_requests, served_model
from distserve.bench.results import cached_share
from distserve.bench.workload import BenchRequest, Limits, synthetic_prompt
from distserve.commands.common import positive_float, positive_int
from shared.metrics import percentiles
from shared.workloads import Trace, WorkloadError, read_trace


def register(sub: Any) -> None:
    p = sub.add_parser("replay", help="replay a request trace against a server",
                       description=__doc__)
    p.add_argument("trace", help="an Azure LLM inference CSV or a Mooncake JSONL trace "
                   "(by extension, or prefixed azure: / mooncake:)")
    p.add_argument("--speed", type=positive_float, default=1.0,
                   help="time compression: 2 sends the trace twice as fast (default: 1)")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", help="model name (default: the server's first)")
    p.add_argument("--limit", type=positive_int, help="only the first N requests")
    p.add_argument("--length-scale", type=positive_float, default=1.0,
                   help="multiply the trace's lengths (fit them to a small model)")
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--max-output", type=int, default=512)
    p.add_argument("--timeout", type=positive_float, default=600.0, help="per request, seconds")
    p.add_argument("--out", type=Path, help="write every request's record here (JSON)")
    p.set_defaults(parser=p, run=run)


def trace_from_spec(spec: str) -> Trace:
    kind, _, path = spec.partition(":")
    if kind not in ("azure", "mooncake"):
        path, kind = spec, "azure" if spec.endswith(".csv") else "mooncake"
    return read_trace(kind, path)


def trace_requests(trace: Trace, speed: float, limits: Limits,
                   limit: int | None = None) -> list[BenchRequest]:
    """The trace's requests with synthetic prompts of its (scaled) lengths, at its times;
    where it says which prompts share a prefix, they share one (`synthetic_prompt`)."""
    n = min(limit or len(trace.times_s), len(trace.times_s))
    block = limits.block(trace.block_tokens)
    out = []
    for i in range(n):
        prompt = limits.prompt(trace.lengths.prompts[i])
        ids = synthetic_prompt(prompt, trace.prefixes[i] if trace.prefixes else (), block, [i])
        out.append(BenchRequest(i, float(trace.times_s[i]) / speed, ids, prompt,
                                limits.output(trace.lengths.outputs[i])))
    return out


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        trace = trace_from_spec(args.trace)
        requests = trace_requests(trace, args.speed, Limits(args.max_prompt, args.max_output,
                                                            args.length_scale), args.limit)
        model = args.model or asyncio.run(served_model(args.url))
    except WorkloadError as e:
        parser.error(str(e))
    except (httpx.HTTPError, RuntimeError) as e:
        parser.error(f"cannot reach a model at {args.url}/v1/models: {e}")
    console = Console()
    span = requests[-1].arrival_s
    console.print(f"replaying {len(requests)} requests over {span:.0f}s against {args.url}")
    with tqdm(total=len(requests), unit="req", desc="replay", dynamic_ncols=True) as bar:
        result = asyncio.run(run_requests(Target(args.url, model, timeout_s=args.timeout),
                                          requests, len(requests) / max(span, 1e-9),
                                          lambda _: bar.update()))
    done = [r for r in result.records if r.ok]
    failed = [r for r in result.records if not r.ok]
    ttft = percentiles([r.ttft for r in done if r.ttft is not None])
    tpot = percentiles([r.tpot for r in done if r.tpot is not None])
    console.print(f"{len(done)} completed, {len(failed)} failed in {result.duration_s:.0f}s; "
                  f"TTFT p50 {ttft['p50']:.3f}s p90 {ttft['p90']:.3f}s; TPOT p50 "
                  f"{tpot['p50']:.4f}s p90 {tpot['p90']:.4f}s; the prefix caches held "
                  f"{cached_share(done):.1%} of the prompt tokens", markup=False)
    for r in failed[:10]:
        console.print(f"  request {r.index} failed: {r.error}")
    if args.out:
        args.out.write_text(json.dumps([r.to_json() for r in result.records], indent=1))
    return 1 if failed else 0
