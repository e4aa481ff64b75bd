"""`distserve profile`: run the engine over a grid of prefill batches, chunks continuing a
prompt and decode steps, fit the latency model and find L_m. The only planner module that
touches a device."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from services.planner.fitting import (
    CachedPoint,
    DecodePoint,
    PrefillPoint,
    cached_report,
    fit_cached,
    fit_phase,
)
from services.planner.latency import Contention
from services.planner.models import MODELS, from_config
from services.planner.profiles import Profile, saturation_length
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.meta import read_config
from shared.engine.model_runner import dtype_name
from shared.engine.request import Request, SamplingParams
from shared.engine.scheduler import StepShape
from shared.host import cpu_description


@dataclass(frozen=True)
class Grid:
    prefill_lengths: tuple[int, ...] = (16, 32, 64, 128, 256, 384, 512, 768, 1024)
    prefill_batches: tuple[int, ...] = (1, 2, 4)
    max_prefill_tokens: int = 2048
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 48)
    decode_contexts: tuple[int, ...] = (64, 256, 512)
    repeats: int = 3
    # (new tokens, tokens cached before them) of chunks continuing a prompt (chunked prefill)
    cached_chunks: tuple[tuple[int, int], ...] = ((128, 256), (128, 512), (128, 896),
                                                   (256, 256), (256, 768))

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """(length, batch) of every prefill point, at most `max_prefill_tokens` a batch."""
        return [(length, batch) for length in self.prefill_lengths
                for batch in self.prefill_batches if length * batch <= self.max_prefill_tokens]

    @property
    def points(self) -> int:
        return self.points_for(pipelined=False)

    def points_for(self, pipelined: bool) -> int:
        """The points profiled: a pipeline measures no chunks over cached tokens (a step of
        it runs as one of several micro-batches)."""
        return len(self.prefill_shapes()) + len(self.decode_batches) * len(
            self.decode_contexts) + (0 if pipelined else len(self.cached_chunks))

    @property
    def decode_tokens(self) -> int:
        """The most tokens a decode point's requests generate past their context."""
        return self.repeats + 6

    def within(self, context: int) -> Grid:
        """The points a model of `context` tokens can run: prompts and their first token,
        decode contexts and the tokens a point decodes past them."""
        lengths = tuple(n for n in self.prefill_lengths if n < context)
        contexts = tuple(c for c in self.decode_contexts if c + self.decode_tokens <= context)
        if not lengths or not contexts:
            raise ValueError(f"a context of {context} tokens is too short to profile")
        chunks = tuple((n, k) for n, k in self.cached_chunks if n + k < context)
        return dataclasses.replace(self, prefill_lengths=lengths, decode_contexts=contexts,
                                   cached_chunks=chunks)

    @classmethod
    def quick(cls) -> Grid:
        return cls((32, 64, 128, 256, 512), (1, 2), 1024, (1, 2, 4, 8, 16, 32), (64, 256), 5,
                   ((128, 128), (128, 384)))


def _prompt(length: int, vocab: int, salt: int) -> list[int]:
    gen = torch.Generator().manual_seed(length * 7919 + salt)
    return torch.randint(100, vocab - 100, (length,), generator=gen).tolist()


class Profiler:
    """Times the engine's steps over a grid. A pipeline (pp > 1) runs a step as one
    micro-batch among several under way, so there it times what a request sees instead: a
    prompt batch from its first step to its first tokens, and a decode round (a token for
    every request) at steady state."""

    def __init__(self, engine: Engine, grid: Grid) -> None:
        self.engine, self.grid = engine, grid
        self._ids = iter(range(10**9))
        self.pipelined = engine.runner.depth > 1

    def _add(self, length: int, max_tokens: int, salt: int) -> str:
        rid = f"prof-{next(self._ids)}"
        vocab = self.engine.model_config.vocab_size
        self.engine.add_request(rid, _prompt(length, vocab, salt),
                                SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        return rid

    def _step_until(self, requests: list[Request | None], tokens: int) -> None:
        """Step until each of `requests` has `tokens` output tokens or has ended."""
        while any(r is not None and len(r.output_ids) < tokens and not r.status.finished
                  for r in requests):
            self.engine.step()

    def _drain(self) -> None:
        while self.engine.has_work():  # a pipeline's steps under way
            self.engine.step()

    def _first_tokens_ms(self, length: int, prompts: int) -> float:
        """ms from `prompts` prompts of `length` going in together to the last one's first
        token (one step, but on a pipeline)."""
        ids = [self._add(length, 1, i) for i in range(prompts)]
        requests = [self.engine.scheduler.get(rid) for rid in ids]
        start = time.perf_counter()
        self._step_until(requests, 1)
        elapsed = (time.perf_counter() - start) * 1e3
        self._drain()
        return elapsed

    def prefill_point(self, length: int, batch: int) -> PrefillPoint:
        self._first_tokens_ms(length, batch)  # warm-up
        # the fastest repeat: other processes on a shared machine only ever add time
        return PrefillPoint((length,) * batch, min(self._first_tokens_ms(length, batch)
                                                   for _ in range(self.grid.repeats)))

    @contextlib.contextmanager
    def _scheduling(self, **changes: Any) -> Iterator[None]:
        """The scheduler runs with `changes` to its config for a while: a step's token budget
        (one prompt of that length a step), with `chunked_prefill` prompts in chunks of it."""
        scheduler = self.engine.scheduler
        config = scheduler.config
        scheduler.config = dataclasses.replace(config, **changes)
        try:
            yield
        finally:
            scheduler.config = config

    def prefill_stage_share(self, length: int) -> float:
        """How long a pipeline's slowest stage is busy with a prompt of `length`, as a share of
        the prompt's latency: prompts that go in together, one a step, come out a stage's time
        apart (the micro-batches overlap), so `count` of them take the latency and `count - 1`
        stages. Kept within [1 / pp, 1]: below is a stage faster than an even split of the
        work, above no overlap at all."""
        depth = self.engine.runner.depth
        count = 2 * depth + 2

        def through(prompts: int) -> float:
            with self._scheduling(max_batch_tokens=length):
                return self._first_tokens_ms(length, prompts)
        through(count)  # warm-up
        alone = min(through(1) for _ in range(self.grid.repeats))
        together = min(through(count) for _ in range(self.grid.repeats))
        return min(1.0, max(1 / depth, (together - alone) / (count - 1) / alone))

    def _chunk_ms(self, length: int, cached: int, salt: int) -> float:
        """ms of one step computing the last `length` tokens of a prompt whose first `cached`
        tokens an earlier step computed (0: a whole prompt of `length`)."""
        self._add(cached + length, 1, salt)
        if cached:
            with self._scheduling(max_batch_tokens=cached, chunked_prefill=True):
                self.engine.step()
            assert self.engine.last_shape == StepShape((cached,), 0, 0), \
                f"the first chunk ran as {self.engine.last_shape}"
        with self._scheduling(max_batch_tokens=length, chunked_prefill=True):
            start = time.perf_counter()
            self.engine.step()
            elapsed = (time.perf_counter() - start) * 1e3
        chunk = StepShape((length,), 0, 0, (cached,) if cached else ())
        assert self.engine.last_shape == chunk, f"the chunk ran as {self.engine.last_shape}"
        self._drain()
        return elapsed

    def cached_point(self, length: int, cached: int) -> CachedPoint:
        """A chunk of `length` tokens over `cached` ones and a whole prompt of `length`, each
        the fastest of the repeats after a warm-up (one engine, not a pipeline)."""
        assert not self.pipelined, "a pipeline runs a step as one of several micro-batches"

        def fastest(over: int) -> float:
            self._chunk_ms(length, over, 0)  # warm-up
            return min(self._chunk_ms(length, over, i) for i in range(self.grid.repeats))
        return CachedPoint(length, cached, fastest(cached), fastest(0))

    def decode_point(self, batch: int, context: int) -> DecodePoint:
        if self.pipelined:
            return self._decode_rounds(batch, context)
        steps = self.grid.repeats + 2
        ids = [self._add(context, steps + 2, i) for i in range(batch)]
        requests = [self.engine.scheduler.get(rid) for rid in ids]
        while any(r is not None and not r.output_ids for r in requests):
            self.engine.step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            self.engine.step()
            times.append((time.perf_counter() - start) * 1e3)
        for rid in ids:
            self.engine.abort(rid)
        return DecodePoint(batch, batch * (context + 2), min(times[1:]))

    def _decode_rounds(self, batch: int, context: int) -> DecodePoint:
        """The median round of a pipeline decoding `batch` requests: from every request
        having k tokens to every one having k + 1, once each has two (the pipeline full)."""
        rounds = self.grid.repeats + 2
        ids = [self._add(context, self.grid.decode_tokens, i) for i in range(batch)]
        requests = [self.engine.scheduler.get(rid) for rid in ids]
        self._step_until(requests, 2)
        times = []
        for k in range(3, rounds + 3):
            start = time.perf_counter()
            self._step_until(requests, k)
            times.append((time.perf_counter() - start) * 1e3)
        for rid in ids:
            self.engine.abort(rid)
        self._drain()
        return DecodePoint(batch, batch * (context + 2 + rounds // 2), statistics.median(times))

    def stage_length(self) -> int:
        """The prompt a pipeline's stage share is measured at: the grid's longest up to 512."""
        return max([n for n in self.grid.prefill_lengths if n <= 512] or
                   [min(self.grid.prefill_lengths)])

    def run(self, progress: Callable[[str], None]
            ) -> tuple[list[PrefillPoint], list[DecodePoint], list[CachedPoint]]:
        """The grid's points: whole prompts, decode steps, and (not on a pipeline) chunks
        continuing a prompt."""
        g = self.grid
        prefill = []
        for length, batch in g.prefill_shapes():
            progress(f"prefill {batch} x {length} tokens")
            prefill.append(self.prefill_point(length, batch))
        cached = []
        for length, over in () if self.pipelined else g.cached_chunks:
            progress(f"a chunk of {length} tokens over {over} cached")
            cached.append(self.cached_point(length, over))
        decode = []
        for context in g.decode_contexts:
            for batch in g.decode_batches:
                progress(f"decode batch {batch} at context {context}")
                decode.append(self.decode_point(batch, context))
        return prefill, decode, cached


NEIGHBOUR_MODES = ("idle", "decode", "prefill")


@dataclass(frozen=True)
class ContentionLengths:
    """What the contention is measured at: a decode step at `context`, a prefill of
    `prompt`, the neighbour decoding requests of up to `neighbour_tokens` past `context`;
    256, 512 and 4096 where the model's context holds them."""

    context: int
    prompt: int
    neighbour_tokens: int

    @classmethod
    def fitting(cls, max_context: int) -> ContentionLengths:
        context, prompt = min(256, max_context // 4), min(512, max_context // 2)
        return cls(context, prompt, min(4096, max_context - context - 1))


def _neighbour(config: EngineConfig, mode: Any, ready: Any, steps: Any, batch: int = 1) -> None:
    """A second engine on the host, stepping as `mode` says (an index of NEIGHBOUR_MODES;
    -1: exit): continuously decoding `batch` requests at the contention's context, or
    prefilling its prompts one after another; `steps` counts its steps."""
    engine = Engine(config)
    lengths = ContentionLengths.fitting(engine.model_config.max_context)
    profiler, decoding = Profiler(engine, Grid()), list[str]()
    ready.set()
    try:
        while mode.value >= 0:
            phase = NEIGHBOUR_MODES[mode.value]
            if phase != "decode" and decoding:
                for rid in decoding:
                    engine.abort(rid)
                decoding = []
            if phase == "decode":
                decoding = [rid for rid in decoding if engine.scheduler.get(rid) is not None]
                decoding += [profiler._add(lengths.context, lengths.neighbour_tokens, 0)
                             for _ in range(batch - len(decoding))]
                engine.step()
            elif phase == "prefill":
                profiler._add(lengths.prompt, 1, 0)
                engine.step()
            else:
                time.sleep(0.01)
                continue
            steps.value += 1
    finally:
        engine.close()


def measure_contention(engine: Engine, config: EngineConfig, rounds: int = 3,
                       decode_steps: int = 40, prefills: int = 2,
                       progress: Callable[[str], None] = lambda _: None) -> Contention:
    """How much longer `engine`'s steps take while a second engine of `config` in another
    process decodes or prefills beside it: a batch-1 decode step at a 256-token context and
    a 512-token prefill (ContentionLengths), each round's medians against the same round's
    with the neighbour idle, the median of the rounds' ratios. One round alone drifted with
    the host: on a 2-vCPU Zen 4, four of them measured a decode step beside a prefilling
    neighbour at 0.95-1.27x and beside a decoding one at 1.05-1.49x, minutes apart."""
    measured = contention_rounds(engine, config, rounds, decode_steps, prefills, progress)

    def slowdown(beside: str, phase: int) -> float:  # a neighbour only ever adds time
        return max(1.0, statistics.median(round_ratios(measured, beside, phase)))

    return Contention(decode_by_decode=slowdown("decode", 0),
                      decode_by_prefill=slowdown("prefill", 0),
                      prefill_by_decode=slowdown("decode", 1),
                      prefill_by_prefill=slowdown("prefill", 1))


def round_ratios(measured: Sequence[dict[str, tuple[float, float]]], beside: str,
                 phase: int) -> list[float]:
    """Each round's time of `phase` (0: the decode step, 1: the prefill) beside a neighbour
    doing `beside`, over its own with the neighbour idle (`contention_rounds`' rounds)."""
    return [r[beside][phase] / r["idle"][phase] for r in measured]


def contention_rounds(engine: Engine, config: EngineConfig, rounds: int = 3,
                      decode_steps: int = 40, prefills: int = 2,
                      progress: Callable[[str], None] = lambda _: None,
                      neighbour_batch: int = 1) -> list[dict[str, tuple[float, float]]]:
    """`engine`'s median decode step and prefill (seconds) beside a second engine of
    `config` in another process, by what the neighbour does (NEIGHBOUR_MODES; decoding
    `neighbour_batch` requests), a dict a round: the modes take turns within each round, so
    the host's drift over the minute meets them alike."""
    if neighbour_batch < 1:
        raise ValueError(f"the neighbour decodes at least 1 request, not {neighbour_batch}")
    context = multiprocessing.get_context("spawn")
    mode, ready, steps = context.Value("i", 0), context.Event(), context.Value("l", 0)
    neighbour = context.Process(target=_neighbour, daemon=True,
                                args=(config, mode, ready, steps, neighbour_batch))
    neighbour.start()
    profiler = Profiler(engine, Grid())
    lengths = ContentionLengths.fitting(engine.model_config.max_context)
    try:
        while not ready.wait(1.0):
            if not neighbour.is_alive():
                raise RuntimeError(f"the neighbour engine exited (code {neighbour.exitcode}) "
                                   "before it started")
        profiler._first_tokens_ms(lengths.prompt, 1)  # warm-up
        measured = []
        for round_ in range(rounds):
            medians: dict[str, tuple[float, float]] = {}
            for i, phase in enumerate(NEIGHBOUR_MODES):
                progress(f"contention, round {round_ + 1} of {rounds}: steps beside a "
                         f"neighbour {phase}")
                mode.value = i
                # the neighbour is in its new loop (decoding: past its requests' prefills)
                _settle(steps, {"idle": 0, "decode": 1 + neighbour_batch}.get(phase, 2))
                before = steps.value
                medians[phase] = (_decode_median(profiler, lengths.context, decode_steps),
                                  _prefill_median(profiler, lengths.prompt, prefills))
                if phase != "idle" and steps.value == before:
                    raise RuntimeError(f"the neighbour engine took no step while {phase}: "
                                       "nothing was measured beside it")
            measured.append(medians)
    finally:
        mode.value = -1
        neighbour.join(60)
        if neighbour.is_alive():
            neighbour.kill()
    return measured


def _settle(steps: Any, more: int, timeout_s: float = 60.0) -> None:
    """Wait until the neighbour has taken `more` steps (its first one in a new mode may be
    a prefill of the request it then decodes), and a second besides."""
    start, deadline = steps.value, time.monotonic() + timeout_s
    while steps.value < start + more and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)


def _decode_median(profiler: Profiler, context: int, steps: int) -> float:
    engine = profiler.engine
    rid = profiler._add(context, steps + 4, 1)
    engine.step()  # its prefill
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.abort(rid)
    return statistics.median(times)


def _prefill_median(profiler: Profiler, prompt: int, prompts: int) -> float:
    """The median of `prompts` prefills, one after another (not the fastest, as a profile's
    point takes: a neighbour's slowdown is what is measured)."""
    return statistics.median(profiler._first_tokens_ms(prompt, 1)
                             for _ in range(prompts)) / 1e3


def enough_cores_for_contention(threads: int) -> bool:
    """Room for a second engine of `threads` threads (0: torch's default, every core)
    beside the profiled one."""
    cores = len(os.sched_getaffinity(0))
    return threads > 0 and cores >= 2 * threads


def device_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    return f"cpu-{torch.get_num_threads()}threads"


def profile_engine(config: EngineConfig, grid: Grid,
                   progress: Callable[[str], None] = lambda _: None,
                   contention: bool = False) -> Profile:
    """The profile of `config`'s engine over `grid` (the points its model's context holds);
    with `contention`, on a CPU, also how its steps slow beside a second engine
    (measure_contention)."""
    grid = grid.within(read_config(config.model).max_context)
    biggest = max(grid.max_prefill_tokens,
                  max(grid.decode_batches) * (max(grid.decode_contexts) + grid.repeats + 8),
                  max((n + k for n, k in grid.cached_chunks), default=0))
    config = config.with_scheduler(max_batch_tokens=grid.max_prefill_tokens,
                                   max_running=max(max(grid.decode_batches),
                                                   max(grid.prefill_batches)))
    engine = Engine(config)
    try:
        kv_bytes = engine.runner.kv.data.itemsize  # float32 on a CPU, whatever it computes in
        spec = MODELS.get(config.model) or from_config(
            engine.model_config, engine.runner.dtype.itemsize, kv_bytes)
        per_token = engine.model_config.kv_bytes_per_token(kv_bytes)
        needed = biggest * per_token
        have = engine.blocks.num_blocks * engine.blocks.block_size * per_token
        if have < needed:
            raise ValueError(f"the profiling grid needs a KV pool of {needed / 2**20:.0f} MiB, "
                             f"the budget holds {have / 2**20:.0f} MiB: raise --kv-cache-mb")
        profiler = Profiler(engine, grid)
        prefill, decode, chunks = profiler.run(progress)
        stage = 0.0
        if profiler.pipelined:
            progress(f"pipeline stages at {profiler.stage_length()} tokens")
            stage = profiler.prefill_stage_share(profiler.stage_length())
        beside = Contention()
        if contention and engine.runner.device.type == "cpu":
            beside = measure_contention(engine, config, progress=progress)
    finally:
        engine.close()
    coefficients, report = fit_phase(prefill, decode)
    coefficients = dataclasses.replace(coefficients, prefill_stage=stage)
    if chunks:
        coefficients = dataclasses.replace(coefficients, prefill_cached=fit_cached(chunks))
        report |= cached_report(coefficients, chunks)
    pipeline = config.pp > 1  # measured as latencies and rounds: kept apart from by_tp
    return Profile(model=spec, device=device_name(engine.runner.device),
                   device_memory_bytes=device_memory_bytes(engine.runner.device),
                   by_tp={} if pipeline else {config.tp: coefficients},
                   pipelines={(config.tp, config.pp): coefficients} if pipeline else {},
                   l_m=saturation_length(coefficients),
                   fit=report, host=cpu_description() if engine.runner.device.type == "cpu"
                   else "", contention=beside, dtype=dtype_name(engine.runner.dtype))
