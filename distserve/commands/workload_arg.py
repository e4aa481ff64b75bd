"""`--workload` specs shared by plan, simulate and bench:

    humaneval            the 164 HumanEval prompts' token counts, each with its canonical
                         solution's as the output (what `bench` sends by default)
    sharegpt:PATH        real ShareGPT prompts (token counts), Azure-trace output lengths
    azure:PATH           Azure LLM inference trace CSV (lengths; arrivals with --arrival trace)
    mooncake:PATH        Mooncake JSONL trace (likewise)
    fixed:PROMPT:OUTPUT  every request alike
"""

from __future__ import annotations

import argparse
import functools
import sys

import numpy as np

from distserve.commands.common import positive_int
from shared.workloads import (
    Lengths,
    Workload,
    WorkloadError,
    fixed_lengths,
    parse_fixed,
    read_trace,
    sharegpt_lengths,
)

WORKLOAD_HELP = "humaneval, sharegpt:PATH, azure:PATH, mooncake:PATH or fixed:PROMPT:OUTPUT"


@functools.cache
def _count_tokens() -> object:
    from shared.engine.meta import read_tokenizer

    tokenizer = read_tokenizer("smollm2-135m")
    return lambda text: len(tokenizer.encode(text))


def add_context_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-context", type=positive_int, default=2048,
                   help="the model's context in tokens (default: %(default)s)")
    p.add_argument("--fit", choices=("drop", "clip"), default="drop",
                   help="requests longer than --max-context: drop them, as the DistServe "
                        "artifact and vLLM's benchmark do, or clip their lengths (prompt to "
                        "half the context) (default: %(default)s)")


def parse_workload(spec: str, cv: float = 1.0, replay_arrivals: bool = False,
                   max_context: int | None = None, fit: str = "drop") -> Workload:
    """`max_context`: requests longer than the model's context are dropped (`fit="drop"`, as
    the DistServe artifact prepares its datasets) or cut down (`"clip"`: prompts to half the
    context, prompt + output to all of it)."""
    kind, _, rest = spec.partition(":")
    times: np.ndarray | None = None
    lengths: Lengths
    if kind == "fixed":
        lengths = fixed_lengths(*parse_fixed(spec))
    elif kind == "humaneval" and not rest:
        from distserve.bench.workload import Limits, parse_bench_workload

        lengths = parse_bench_workload(spec, Limits()).as_workload().lengths
    elif kind == "sharegpt" and rest:
        lengths = sharegpt_lengths(rest, _count_tokens())  # type: ignore[arg-type]
    elif kind in ("azure", "mooncake") and rest:
        trace = read_trace(kind, rest)
        lengths, times = trace.lengths, trace.times_s if replay_arrivals else None
    else:
        raise WorkloadError(f"unknown workload {spec!r}: use {WORKLOAD_HELP}")
    if max_context is not None and fit == "drop":
        total = len(lengths.prompts)
        try:
            lengths = lengths.within(max_context)
        except WorkloadError as e:
            raise WorkloadError(f"{e}: use --fit clip or a longer --max-context") from None
        if len(lengths.prompts) < total:
            print(f"workload: {len(lengths.prompts)} of {total} requests fit the "
                  f"{max_context}-token context (prompt + output); the rest are left out",
                  file=sys.stderr)
    elif max_context is not None:
        lengths = lengths.clipped(max_context // 2, max_context)
    return Workload(lengths, cv=cv, trace_times=times)
