"""`--workload` specs shared by plan, simulate and bench:

    humaneval            the 164 HumanEval prompts' token counts, each with its canonical
                         solution's as the output (what `bench` sends by default)
    sharegpt:PATH        real ShareGPT prompts (token counts), Azure-trace output lengths
    azure:PATH           Azure LLM inference trace CSV (lengths; arrivals with --arrival trace)
    mooncake:PATH        Mooncake JSONL trace (likewise; with --prefix-cache, its prompts'
                         shared prefixes priced as found in each instance's cache)
    chat:SYSTEM:USER:OUTPUT:TURNS[:ACTIVE]
                         conversations (shared.workloads.Chat; their prefixes likewise)
    fixed:PROMPT:OUTPUT  every request alike
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys

import numpy as np

from distserve.commands.common import positive_int
from shared.workloads import (
    CACHE_PAGE,
    NO_CACHE,
    POOL_CACHE,
    Lengths,
    PrefixCaching,
    Workload,
    WorkloadError,
    cached_in,
    fixed_lengths,
    parse_chat,
    parse_fixed,
    read_trace,
    sharegpt_lengths,
)

WORKLOAD_HELP = ("humaneval, sharegpt:PATH, azure:PATH, mooncake:PATH, "
                 "chat:SYSTEM:USER:OUTPUT:TURNS[:ACTIVE] or fixed:PROMPT:OUTPUT")


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
    p.add_argument("--prefix-cache", type=cache_size, metavar="pool|TOKENS|unlimited",
                   default=NO_CACHE,
                   help="a workload that says which prompts share prefixes (chat, or "
                        "Mooncake's hash_ids): each instance keeps the prompts it computes "
                        "in a prefix cache, its KV pool (pool, as the workers do) or one of "
                        "this many tokens, least recently used first out, and a prompt's "
                        "start found in the instance it goes to is not computed; the "
                        "prompts are taken in order (default: every prompt computed whole)")


def cache_size(text: str) -> int | None:
    """--prefix-cache: `pool` (POOL_CACHE), a number of tokens, or `unlimited` (None)."""
    if text in ("pool", "unlimited"):
        return POOL_CACHE if text == "pool" else None
    try:
        return positive_int(text)
    except (argparse.ArgumentTypeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"pool, a number of tokens or 'unlimited', got {text!r}") from None


def parse_workload(spec: str, cv: float = 1.0, replay_arrivals: bool = False,
                   max_context: int | None = None, fit: str = "drop",
                   prefix_cache: int | None = NO_CACHE) -> Workload:
    """`max_context`: requests longer than the model's context are dropped (`fit="drop"`, as
    the DistServe artifact prepares its datasets) or cut down (`"clip"`: prompts to half the
    context, prompt + output to all of it). `prefix_cache`: of a workload that says which
    prompts share prefixes, each instance's cache of that many tokens (None: unlimited;
    POOL_CACHE: its KV pool), in which a prompt's start found is priced as not computed."""
    kind, _, rest = spec.partition(":")
    if prefix_cache != NO_CACHE and kind not in ("chat", "mooncake"):
        raise WorkloadError(SHARES_NOTHING)
    times: np.ndarray | None = None
    lengths: Lengths
    block_tokens = CACHE_PAGE  # of the prompts' blocks, where they say them
    if kind == "fixed":
        lengths = fixed_lengths(*parse_fixed(spec))
    elif kind == "chat":
        from distserve.bench.workload import CHAT_REQUESTS

        lengths, prefixes = parse_chat(spec).lengths(CHAT_REQUESTS)
        if prefix_cache != NO_CACHE:
            lengths = dataclasses.replace(lengths, prefixes=prefixes)
    elif kind == "humaneval" and not rest:
        from distserve.bench.workload import Limits, parse_bench_workload

        lengths = parse_bench_workload(spec, Limits()).as_workload().lengths
    elif kind == "sharegpt" and rest:
        lengths = sharegpt_lengths(rest, _count_tokens())  # type: ignore[arg-type]
    elif kind in ("azure", "mooncake") and rest:
        trace = read_trace(kind, rest)
        lengths, times = trace.lengths, trace.times_s if replay_arrivals else None
        if prefix_cache != NO_CACHE:
            if trace.prefixes is None:
                raise WorkloadError(SHARES_NOTHING)
            lengths = dataclasses.replace(lengths, prefixes=trace.prefixes)
            block_tokens = trace.block_tokens
    else:
        raise WorkloadError(f"unknown workload {spec!r}: use {WORKLOAD_HELP}")
    if max_context is not None and fit == "drop":
        total = len(lengths.prompts)
        if times is not None and lengths.prefixes is not None:  # (sent in order: each its own)
            times = times[lengths.prompts + lengths.outputs <= max_context]
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
    if lengths.prefixes is not None:  # (of the requests sent, as sent)
        lengths = _with_cache(lengths, block_tokens, prefix_cache)
    return Workload(lengths, cv=cv, trace_times=times)


SHARES_NOTHING = ("--prefix-cache needs a workload that says which prompts share prefixes "
                  "(chat, or a Mooncake trace with hash_ids)")


def _with_cache(lengths: Lengths, block_tokens: int, capacity_tokens: int | None) -> Lengths:
    """`lengths`, whose prompts say their blocks of `block_tokens`, cached by each instance
    in `capacity_tokens` (`PrefixCaching`), with the tokens of each that one such cache
    holds as it comes in order (a pool's: an unlimited one's), printed as the share of all
    prompt tokens, with an unlimited cache's, which no instance's beats."""
    assert lengths.prefixes is not None
    one = None if capacity_tokens == POOL_CACHE else capacity_tokens
    cached = cached_in(lengths.prefixes, lengths.prompts, block_tokens, one)
    found = dataclasses.replace(lengths, cached=cached,
                                caching=PrefixCaching(block_tokens, capacity_tokens, one))
    prompts = lengths.mean_prompt
    sized = "" if one is None else \
        f"one {one}-token prefix cache would hold {cached.mean() / prompts:.1%}, "
    print(f"workload: of the prompt tokens sent in order, {sized}an unlimited prefix cache "
          f"would hold {found.mean_cached / prompts:.1%}; each instance keeps its own"
          + (" in its KV pool" if capacity_tokens == POOL_CACHE else ""), file=sys.stderr)
    return found
