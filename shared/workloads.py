"""Workloads: arrival processes x prompt/output length distributions, and readers for the
public formats (ShareGPT JSON, Azure LLM inference CSV, Mooncake JSONL). Data files are read
from paths the user gives; nothing here ships data.

Common random numbers: a workload is drawn once at unit rate and scaled to each rate, so the
attainment-versus-rate curve of a system is smooth and comparable between systems.
"""

from __future__ import annotations

import collections
import csv
import functools
import io
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

# Output lengths of the Azure LLM inference trace (conversation, 2023; Patel et al., ISCA'24)
# fitted as a lognormal: mean and std of log(tokens) over its 19,366 requests (median 129).
AZURE_CONV_OUTPUT_LOG_MEAN = 5.019
AZURE_CONV_OUTPUT_LOG_STD = 0.859


class WorkloadError(ValueError):
    pass


@dataclass(frozen=True)
class WorkloadRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0  # of the prompt, found in a prefix cache (not computed)
    # where instances keep prefixes: the prompt as blocks (`Prefix`), and how an instance
    # caches them; a simulator then finds its cached tokens in the instance it goes to
    prefix: Prefix = ()
    caching: PrefixCaching | None = None


@dataclass(frozen=True)
class Lengths:
    """Paired (prompt, output) token lengths to resample from, and where a live workload was
    seen, the tokens of each prompt its instances found in their prefix caches (`cached`;
    None: every prompt computed whole). Of a workload that says which prompts share
    prefixes, priced with each instance's own cache: the prompts as blocks (`prefixes`) and
    how an instance caches them (`caching`); `cached` is then what one cache of that size,
    seeing every prompt in order, finds (`PrefixCaching.counted`)."""

    prompts: np.ndarray
    outputs: np.ndarray
    cached: np.ndarray | None = None
    prefixes: tuple[Prefix, ...] | None = None
    caching: PrefixCaching | None = None

    def __post_init__(self) -> None:
        if len(self.prompts) == 0 or len(self.prompts) != len(self.outputs):
            raise WorkloadError("a length distribution needs equal, non-empty prompt/output lists")
        if self.cached is not None and (len(self.cached) != len(self.prompts) or
                                        np.any(self.cached >= self.prompts)):
            raise WorkloadError("a prompt's cached tokens are fewer than its tokens, each")
        if self.prefixes is not None and len(self.prefixes) != len(self.prompts):
            raise WorkloadError("a prompt's blocks for each prompt")

    def index(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """`n` requests drawn (with replacement): their positions."""
        return rng.integers(0, len(self.prompts), n)

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        index = self.index(n, rng)
        return self.prompts[index], self.outputs[index]

    def cached_at(self, index: np.ndarray) -> np.ndarray:
        """The cached tokens of the requests at `index` (zeros where none are known)."""
        return np.zeros(len(index), dtype=int) if self.cached is None else self.cached[index]

    def within(self, max_total: int) -> Lengths:
        """Only the requests whose prompt + output fit `max_total` tokens, as the DistServe
        artifact and vLLM's benchmark prepare their datasets for a model's context."""
        keep = self.prompts + self.outputs <= max_total
        if not keep.any():
            raise WorkloadError(f"no request of the workload fits a {max_total}-token context")
        return Lengths(self.prompts[keep], self.outputs[keep],
                       None if self.cached is None else self.cached[keep],
                       None if self.prefixes is None else
                       tuple(p for p, k in zip(self.prefixes, keep, strict=True) if k),
                       self.caching)

    def clipped(self, max_prompt: int, max_total: int) -> Lengths:
        """Scale lengths down to fit a model: prompts to `max_prompt`, prompt + output to
        `max_total` (keeping at least one output token)."""
        prompts = np.clip(self.prompts, 1, max_prompt)
        outputs = np.clip(self.outputs, 1, np.maximum(1, max_total - prompts))
        return Lengths(prompts, outputs,
                       None if self.cached is None else np.minimum(self.cached, prompts - 1),
                       self.prefixes, self.caching)

    @property
    def mean_prompt(self) -> float:
        return float(np.mean(self.prompts))

    @property
    def mean_output(self) -> float:
        return float(np.mean(self.outputs))

    @property
    def mean_cached(self) -> float:
        """Of a prompt, the tokens a prefix cache holds, on average (0: none known); where
        each instance caches its own (`caching`), the most they can: what one unlimited
        cache of every prompt finds (several caches of a size, each sent some of the
        prompts, can find more than one of that size sent all; none finds more than that)."""
        if self.caching is not None and self.prefixes is not None:
            return self._most_cached
        return 0.0 if self.cached is None else float(np.mean(self.cached))

    @functools.cached_property
    def _most_cached(self) -> float:
        assert self.caching is not None and self.prefixes is not None
        if self.caching.counted is None and self.cached is not None:  # counted unlimited
            return float(np.mean(self.cached))
        return float(np.mean(cached_in(self.prefixes, self.prompts, self.caching.block_tokens,
                                       None)))

    @property
    def mean_computed(self) -> float:
        """Of a prompt, the tokens a prefill computes, on average: those not cached."""
        return self.mean_prompt - self.mean_cached


def parse_fixed(spec: str) -> tuple[int, int]:
    """(prompt, output) of a `fixed:PROMPT:OUTPUT` workload spec."""
    try:
        prompt, output = (int(x) for x in spec.partition(":")[2].split(":"))
    except ValueError:
        raise WorkloadError(f"fixed:PROMPT:OUTPUT, got {spec!r}") from None
    if prompt < 1 or output < 1:
        raise WorkloadError("fixed lengths must be positive")
    return prompt, output


def fixed_lengths(prompt: int, output: int) -> Lengths:
    return Lengths(np.array([prompt]), np.array([output]))


def lognormal_outputs(n: int, seed: int = 0, log_mean: float = AZURE_CONV_OUTPUT_LOG_MEAN,
                      log_std: float = AZURE_CONV_OUTPUT_LOG_STD) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.maximum(1, np.rint(rng.lognormal(log_mean, log_std, n))).astype(np.int64)


# -- arrivals ---------------------------------------------------------------------------

def unit_rate_gaps(n: int, rng: np.random.Generator, cv: float = 1.0) -> np.ndarray:
    """Inter-arrival gaps with mean 1 s: exponential (Poisson, cv = 1) or gamma (any cv)."""
    if cv <= 0:
        raise WorkloadError(f"the arrival CV must be positive, got {cv}")
    if cv == 1.0:
        return rng.exponential(1.0, n)
    shape = 1.0 / cv**2
    return rng.gamma(shape, 1.0 / shape, n)


@dataclass(frozen=True)
class Workload:
    """Lengths plus an arrival pattern: `cv` for Poisson/gamma arrivals, or the relative
    arrival times of a trace (replayed, time-scaled to the requested rate). Lengths drawn
    at random, but those of prompts that share prefixes (`Lengths.prefixes`): in order, as
    a cache meets them, and past the last one again as new prompts (`renamed`)."""

    lengths: Lengths
    cv: float = 1.0
    trace_times: np.ndarray | None = None

    def requests(self, rate: float, n: int, seed: int = 0) -> list[WorkloadRequest]:
        if rate <= 0:
            raise WorkloadError(f"the request rate must be positive, got {rate}")
        rng = np.random.default_rng(seed)
        if self.trace_times is not None:
            times = scaled_trace(self.trace_times, n)
        else:
            times = np.cumsum(unit_rate_gaps(n, rng, self.cv))
        lengths = self.lengths
        if lengths.prefixes is None:
            index = lengths.index(n, rng)
            return [WorkloadRequest(float(t) / rate, int(p), int(o), int(c))
                    for t, p, o, c in zip(times, lengths.prompts[index],
                                          lengths.outputs[index], lengths.cached_at(index),
                                          strict=True)]
        index = np.arange(n) % len(lengths.prompts)
        return [WorkloadRequest(float(t) / rate, int(p), int(o), int(c), prefix,
                                lengths.caching)
                for t, p, o, c, prefix in zip(times, lengths.prompts[index],
                                              lengths.outputs[index], lengths.cached_at(index),
                                              renamed(lengths.prefixes, n), strict=True)]


def renamed(prefixes: Sequence[Prefix], n: int) -> list[Prefix]:
    """`n` prompts' blocks: `prefixes` in turn, and past their end, again under new ids (a
    block of the k-th pass is one of the first's plus k times one more than the largest), so
    that no prompt finds a block of an earlier pass cached: the workload goes on with new
    prompts as its own come, not with its prompts sent again."""
    out = list(prefixes[:n])
    if n > len(prefixes):
        span = 1 + max((max(p) for p in prefixes if p), default=0)
        for k in range(len(prefixes), n):
            shift = k // len(prefixes) * span
            out.append(tuple(block + shift for block in prefixes[k % len(prefixes)]))
    return out


def scaled_trace(times: np.ndarray, n: int) -> np.ndarray:
    """The first `n` arrivals of a trace (repeated if short), rescaled so that their own mean
    gap is 1 s: the replayed segment runs at exactly the requested rate."""
    reps = -(-n // len(times))
    span = float(times[-1] - times[0]) + float(np.mean(np.diff(times))) if len(times) > 1 else 1.0
    tiled = np.concatenate([times - times[0] + i * span for i in range(reps)])[:n]
    mean_gap = (tiled[-1] - tiled[0]) / (n - 1) if n > 1 and tiled[-1] > tiled[0] else 1.0
    return tiled / mean_gap


# -- readers ----------------------------------------------------------------------------

Prefix = tuple[int, ...]  # a prompt's blocks, by the ids of the prefixes they end

MOONCAKE_BLOCK_TOKENS = 512  # the prompt tokens each of a Mooncake request's hash_ids covers
CACHE_PAGE = 16  # the tokens a prefix cache finds at a time: the engine's KV block
NO_CACHE = -1  # a prefix cache's size in tokens where there is none (None: unlimited)
POOL_CACHE = -2  # ... where each instance's is its KV pool (its size the instance's)


@dataclass(frozen=True)
class Trace:
    times_s: np.ndarray
    lengths: Lengths
    # each request's prompt as blocks of `block_tokens`, named by ids that equal another
    # prompt's where its prefix up to there is the same (Mooncake's hash_ids); None: unknown
    prefixes: tuple[Prefix, ...] | None = None
    block_tokens: int = MOONCAKE_BLOCK_TOKENS


AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length")


def read_azure_trace(path: str | Path) -> Trace:
    """Azure LLM inference trace CSV: TIMESTAMP, ContextTokens, GeneratedTokens."""
    reader = csv.DictReader(io.StringIO(_read_text(path)))
    if not set(AZURE_COLUMNS) <= set(reader.fieldnames or ()):
        raise WorkloadError(f"{path}: not an Azure trace (needs TIMESTAMP, ContextTokens, "
                            "GeneratedTokens columns)")
    rows = []
    for row in reader:
        try:
            rows.append((datetime.fromisoformat(row["TIMESTAMP"][:26]).timestamp(),
                         int(row["ContextTokens"]), int(row["GeneratedTokens"])))
        except (TypeError, ValueError):
            raise WorkloadError(f"{path} line {reader.line_num} is not an Azure trace row "
                                "(an ISO time and two token counts)") from None
    if not rows:
        raise WorkloadError(f"{path}: an Azure trace without requests")
    stamps, prompts, outputs = (np.array(column) for column in zip(*rows, strict=True))
    return Trace(stamps - stamps[0], Lengths(prompts, outputs))


def read_mooncake_trace(path: str | Path) -> Trace:
    """Mooncake JSONL: timestamp (ms), input_length, output_length per line, and where every
    line has them, its prompt's `hash_ids` (one a 512-token block; equal leading ids, a
    shared prefix)."""
    rows = [_mooncake_row(path, n, line)
            for n, line in enumerate(_read_text(path).splitlines(), 1) if line.strip()]
    if not rows:
        raise WorkloadError(f"{path}: a Mooncake trace without requests")
    times, prompts, outputs = (np.array([row[k] for row in rows]) for k in range(3))
    times = times.astype(float) / 1e3
    prefixes = [row[3] for row in rows]
    return Trace(times - times[0], Lengths(prompts, outputs),
                 None if any(p is None for p in prefixes) else tuple(prefixes))  # type: ignore[arg-type]


def _mooncake_row(path: str | Path, n: int, line: str
                  ) -> tuple[float, int, int, Prefix | None]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise WorkloadError(f"{path} line {n} is not JSON ({e.msg}): not a Mooncake trace "
                            "(JSON lines)") from None
    if not (isinstance(row, dict) and all(isinstance(row.get(k), int | float)
                                          for k in MOONCAKE_FIELDS)):
        raise WorkloadError(f"{path} line {n} is not a Mooncake request (needs timestamp, "
                            "input_length, output_length)")
    ids = row.get("hash_ids")
    if ids is not None and not (isinstance(ids, list) and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
        raise WorkloadError(f"{path} line {n}: its hash_ids are not a list of integers 0 "
                            "or more")
    return (row["timestamp"], row["input_length"], row["output_length"],
            None if ids is None else tuple(ids))


class PrefixCache:
    """A prefix cache of `capacity` blocks (None: unlimited) of `block_tokens`, as the
    prompts it meets fill it: of the blocks that ended an earlier prompt's prefix, kept
    since, it holds what that prompt left of them. A prompt leaves its whole `page`s (an
    engine's KV blocks: the page its last tokens fill in part holds nothing reusable), so of
    a block it fills only in part, the pages it fills. The cache keeps the blocks it saw
    last (LRU), a prompt's own touched as it is computed, its first last: an engine's pool
    frees a request's blocks from its end and evicts the least recently freed first, so a
    prefix's start outlives its end."""

    def __init__(self, block_tokens: int = 1, capacity: int | None = None,
                 page: int = 1) -> None:
        self.block_tokens, self.capacity, self.page = block_tokens, capacity, page
        self.held: collections.OrderedDict[int, int] = collections.OrderedDict()  # -> tokens

    def take(self, ids: Prefix, length: int) -> int:
        """The tokens of a prompt's start (`length` tokens, as blocks `ids`) the cache
        holds as it comes; then the prompt is computed and leaves its own."""
        found, held, size = 0, self.held, self.block_tokens
        for block in ids:
            tokens = held.get(block, 0)
            found += tokens
            if tokens < size:
                break
        left = int(length) // self.page * self.page
        n = min(len(ids), -(-left // size))  # the blocks it leaves pages of
        if n:
            last = ids[n - 1]  # the one it may fill in part; the others it fills
            held[last] = max(min(size, left - (n - 1) * size), held.get(last, 0))
            held.move_to_end(last)
            for block in reversed(ids[:n - 1]):
                held[block] = size
                held.move_to_end(block)
        while self.capacity is not None and len(held) > self.capacity:
            held.popitem(last=False)
        return min(found, int(length))


def prefix_found(prefixes: Sequence[Prefix], prompts: Sequence[int] | np.ndarray,
                 block_tokens: int = 1, capacity: int | None = None,
                 page: int = 1) -> np.ndarray:
    """Of each prompt in turn (`prompts` tokens, as `prefixes`' blocks of `block_tokens`),
    the tokens of its start one `PrefixCache` of `capacity` blocks holds as it comes. Every
    earlier prompt is taken as computed when a prompt comes: the requests of a workload sent
    faster than its prompts are computed find less."""
    cache = PrefixCache(block_tokens, capacity, page)
    return np.array([cache.take(ids, length)
                     for ids, length in zip(prefixes, prompts, strict=True)], dtype=np.int64)


@dataclass(frozen=True)
class PrefixCaching:
    """How each instance caches a workload's prompts: as blocks of `block_tokens`, in a
    cache of `tokens` (None: unlimited; POOL_CACHE: the instance's KV pool). `counted`: the
    size of cache (None: unlimited; NO_CACHE: none) the workload's own `cached_tokens` were
    counted with, its prompts in order: what one instance of that size finds, which a
    simulation of one such instance need not count again."""

    block_tokens: int
    tokens: int | None = None
    counted: int | None = NO_CACHE

    def size(self, pool_tokens: int) -> int | None:
        """The cache's tokens, of an instance whose KV pool holds `pool_tokens`."""
        return pool_tokens if self.tokens == POOL_CACHE else self.tokens

    def cache(self, pool_tokens: int) -> PrefixCache:
        """A new instance's cache, of an instance whose KV pool holds `pool_tokens`."""
        tokens = self.size(pool_tokens)
        return PrefixCache(self.block_tokens,
                           None if tokens is None else tokens // self.block_tokens, CACHE_PAGE)


def cached_in(prefixes: Sequence[Prefix], prompts: np.ndarray, block_tokens: int,
              capacity_tokens: int | None) -> np.ndarray:
    """The tokens of each prompt in turn an engine finds in a prefix cache of
    `capacity_tokens` (None: unlimited): `prefix_found` in the engine's pages, then
    `cached_tokens`."""
    capacity = None if capacity_tokens is None else capacity_tokens // block_tokens
    return cached_tokens(prefix_found(prefixes, prompts, block_tokens, capacity, CACHE_PAGE),
                         prompts)


def cached_tokens(found: np.ndarray, prompts: np.ndarray, page: int = CACHE_PAGE
                  ) -> np.ndarray:
    """The prompt tokens an engine finds cached, of prompts whose first `found` tokens a
    cache holds: whole pages (`page` tokens, its KV block), never the page of a prompt's
    last token, which it computes whatever it holds."""
    whole: np.ndarray = np.minimum(found // page * page,
                                   np.maximum(prompts - 1, 0) // page * page)
    return whole


@dataclass(frozen=True)
class Chat:
    """Conversations (`chat:SYSTEM:USER:OUTPUT:TURNS[:ACTIVE]`): a system prompt of `system`
    tokens all of them share, then `turns` turns, each a user message of `user` tokens
    answered in `output`; a turn's prompt is the system prompt and the conversation so far.
    `active` conversations go on at once, their turns in rounds (request i is a turn of
    conversation i mod `active` of its group), and a conversation ended is followed by a new
    one. Its prompts as blocks of CACHE_PAGE tokens (`prefixes`), so that a prefix cache
    model finds what an engine would: the system prompt's full blocks, and of a turn, the
    conversation's earlier prompt (an earlier answer's KV, made by a decode instance, is not
    in a prefill instance's pool: a turn computes it). The turns are sent open loop: a
    conversation's next turn comes `active` requests after the one before, answered or
    not."""

    system: int
    user: int
    output: int
    turns: int
    active: int = 4

    def __post_init__(self) -> None:
        if min(self.user, self.output, self.turns, self.active) < 1 or self.system < 0:
            raise WorkloadError("chat:SYSTEM:USER:OUTPUT:TURNS[:ACTIVE] takes a system "
                                "prompt of 0 or more tokens and positive others")

    def turn_of(self, i: int) -> tuple[int, int]:
        """Request i's conversation and turn (from 0)."""
        round_, slot = divmod(i, self.active)
        group, turn = divmod(round_, self.turns)
        return group * self.active + slot, turn

    def prompt(self, turn: int) -> int:
        return self.system + (turn + 1) * self.user + turn * self.output

    def prefix(self, conversation: int, turn: int) -> Prefix:
        """A turn's prompt as blocks: those of the system prompt alone shared by every
        conversation (ids from 0), the others the conversation's own (the same in each of
        its turns, as its text so far is). A block the system prompt fills in part is the
        conversation's: no engine shares it."""
        blocks = -(-self.prompt(turn) // CACHE_PAGE)
        shared = self.system // CACHE_PAGE
        own = (conversation + 1) << 24  # apart from the shared ones and every other's
        return tuple(range(shared)) + tuple(own + j for j in range(shared, blocks))

    def lengths(self, n: int) -> tuple[Lengths, tuple[Prefix, ...]]:
        """The first `n` requests' lengths and prompts' blocks, in order."""
        turns = [self.turn_of(i) for i in range(n)]
        prompts = np.array([self.prompt(t) for _, t in turns])
        return (Lengths(prompts, np.full(n, self.output)),
                tuple(self.prefix(c, t) for c, t in turns))


def parse_chat(spec: str) -> Chat:
    try:
        numbers = [int(x) for x in spec.partition(":")[2].split(":")]
    except ValueError:
        numbers = []
    if len(numbers) not in (4, 5):
        raise WorkloadError("chat:SYSTEM:USER:OUTPUT:TURNS[:ACTIVE] (token counts, turns "
                            f"and conversations at once), got {spec!r}")
    return Chat(*numbers)


def read_trace(kind: str, path: str | Path) -> Trace:
    """An `azure` (CSV) or `mooncake` (JSONL) trace."""
    return (read_azure_trace if kind == "azure" else read_mooncake_trace)(path)


def read_sharegpt_prompts(path: str | Path) -> list[str]:
    """ShareGPT JSON: a list of {"conversations": [{"from": "human", "value": ...}, ...]};
    the first human turn of each conversation."""
    try:
        data = json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise WorkloadError(f"{path} is not JSON (line {e.lineno} column {e.colno}: "
                            f"{e.msg}): not a ShareGPT file") from None
    prompts = [p for p in map(_first_human_turn, data if isinstance(data, list) else []) if p]
    if not prompts:
        raise WorkloadError(f"{path}: no ShareGPT conversations with a human turn")
    return prompts


def _first_human_turn(item: object) -> str:
    turns = item.get("conversations") if isinstance(item, dict) else None
    for turn in turns if isinstance(turns, list) else []:
        value = turn.get("value") if isinstance(turn, dict) else None
        if isinstance(value, str) and value and turn.get("from") == "human":
            return value
    return ""


def sharegpt_lengths(path: str | Path, count_tokens: Callable[[str], int],
                     seed: int = 0) -> Lengths:
    """Prompt lengths of real ShareGPT prompts; output lengths from the Azure conversation
    trace's distribution (the file has no responses)."""
    prompts = np.array([max(1, count_tokens(p)) for p in read_sharegpt_prompts(path)])
    return Lengths(prompts, lognormal_outputs(len(prompts), seed))


def _read_text(path: str | Path) -> str:
    p = Path(path)
    if p.is_dir():
        raise WorkloadError(f"{p} is a directory, not a workload file")
    if not p.is_file():
        raise WorkloadError(f"workload file {p} does not exist")
    try:
        return p.read_text()
    except UnicodeDecodeError:
        raise WorkloadError(f"{p} is not a text file") from None
    except OSError as e:
        raise WorkloadError(f"{p}: cannot read it ({e.strerror})") from None
