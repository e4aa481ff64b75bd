"""Workloads: arrival processes x prompt/output length distributions, and readers for the
public formats (ShareGPT JSON, Azure LLM inference CSV, Mooncake JSONL). Data files are read
from paths the user gives; nothing here ships data.

Common random numbers: a workload is drawn once at unit rate and scaled to each rate, so the
attainment-versus-rate curve of a system is smooth and comparable between systems.
"""

from __future__ import annotations

import collections
import csv
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


@dataclass(frozen=True)
class Lengths:
    """Paired (prompt, output) token lengths to resample from, and where a live workload was
    seen, the tokens of each prompt its instances found in their prefix caches (`cached`;
    None: every prompt computed whole)."""

    prompts: np.ndarray
    outputs: np.ndarray
    cached: np.ndarray | None = None

    def __post_init__(self) -> None:
        if len(self.prompts) == 0 or len(self.prompts) != len(self.outputs):
            raise WorkloadError("a length distribution needs equal, non-empty prompt/output lists")
        if self.cached is not None and (len(self.cached) != len(self.prompts) or
                                        np.any(self.cached >= self.prompts)):
            raise WorkloadError("a prompt's cached tokens are fewer than its tokens, each")

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
                       None if self.cached is None else self.cached[keep])

    def clipped(self, max_prompt: int, max_total: int) -> Lengths:
        """Scale lengths down to fit a model: prompts to `max_prompt`, prompt + output to
        `max_total` (keeping at least one output token)."""
        prompts = np.clip(self.prompts, 1, max_prompt)
        outputs = np.clip(self.outputs, 1, np.maximum(1, max_total - prompts))
        return Lengths(prompts, outputs,
                       None if self.cached is None else np.minimum(self.cached, prompts - 1))

    @property
    def mean_prompt(self) -> float:
        return float(np.mean(self.prompts))

    @property
    def mean_output(self) -> float:
        return float(np.mean(self.outputs))

    @property
    def mean_cached(self) -> float:
        """Of a prompt, the tokens a prefix cache holds, on average (0: none known)."""
        return 0.0 if self.cached is None else float(np.mean(self.cached))

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
    arrival times of a trace (replayed, time-scaled to the requested rate)."""

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
        index = self.lengths.index(n, rng)
        lengths = self.lengths
        return [WorkloadRequest(float(t) / rate, int(p), int(o), int(c)) for t, p, o, c in zip(
            times, lengths.prompts[index], lengths.outputs[index], lengths.cached_at(index),
            strict=True)]


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
            isinstance(i, int) and not isinstance(i, bool) for i in ids)):
        raise WorkloadError(f"{path} line {n}: its hash_ids are not a list of integers")
    return (row["timestamp"], row["input_length"], row["output_length"],
            None if ids is None else tuple(ids))


def prefix_hits(prefixes: Sequence[Prefix], capacity: int | None = None) -> np.ndarray:
    """Of each prompt in turn, its leading blocks a prefix cache of `capacity` blocks (None:
    unlimited) holds as it comes: those that ended an earlier prompt's prefix, kept since.
    The cache keeps the blocks it saw last (LRU, as the engine's pool evicts), a prompt's
    own blocks touched as it is computed."""
    held: collections.OrderedDict[int, None] = collections.OrderedDict()
    hits = np.zeros(len(prefixes), dtype=np.int64)
    for i, ids in enumerate(prefixes):
        k = 0
        while k < len(ids) and ids[k] in held:
            k += 1
        hits[i] = k
        for block in ids:
            held[block] = None
            held.move_to_end(block)
        while capacity is not None and len(held) > capacity:
            held.popitem(last=False)
    return hits


def cached_tokens(hits: np.ndarray, prompts: np.ndarray, block_tokens: int,
                  page: int = CACHE_PAGE) -> np.ndarray:
    """The prompt tokens an engine finds cached, of prompts whose first `hits` blocks of
    `block_tokens` are held: the whole pages (`page` tokens, its KV block) of that prefix,
    and never the page of a prompt's last token, which it computes whatever it holds."""
    found = np.minimum(hits * block_tokens, prompts) // page * page
    whole: np.ndarray = np.minimum(found, np.maximum(prompts - 1, 0) // page * page)
    return whole


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
