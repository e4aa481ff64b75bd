"""`--workload` specs shared by plan, simulate and bench:

    sharegpt:PATH        real ShareGPT prompts (token counts), Azure-trace output lengths
    azure:PATH           Azure LLM inference trace CSV (lengths; arrivals with --arrival trace)
    mooncake:PATH        Mooncake JSONL trace (likewise)
    fixed:PROMPT:OUTPUT  every request alike
"""

from __future__ import annotations

import functools

import numpy as np

from shared.workloads import (
    Lengths,
    Workload,
    WorkloadError,
    fixed_lengths,
    parse_fixed,
    read_trace,
    sharegpt_lengths,
)


@functools.cache
def _count_tokens() -> object:
    from shared.engine.gguf_loader import read_gguf_tokenizer
    from shared.engine.tokenizer import TextTokenizer

    tokenizer = TextTokenizer(read_gguf_tokenizer("smollm2-135m"))
    return lambda text: len(tokenizer.encode(text))


def parse_workload(spec: str, cv: float = 1.0, replay_arrivals: bool = False,
                   max_context: int | None = None) -> Workload:
    kind, _, rest = spec.partition(":")
    times: np.ndarray | None = None
    lengths: Lengths
    if kind == "fixed":
        lengths = fixed_lengths(*parse_fixed(spec))
    elif kind == "sharegpt" and rest:
        lengths = sharegpt_lengths(rest, _count_tokens())  # type: ignore[arg-type]
    elif kind in ("azure", "mooncake") and rest:
        trace = read_trace(kind, rest)
        lengths, times = trace.lengths, trace.times_s if replay_arrivals else None
    else:
        raise WorkloadError(
            f"unknown workload {spec!r}: use sharegpt:PATH, azure:PATH, mooncake:PATH or "
            "fixed:PROMPT:OUTPUT")
    if max_context is not None:
        lengths = lengths.clipped(max_context // 2, max_context)
    return Workload(lengths, cv=cv, trace_times=times)
