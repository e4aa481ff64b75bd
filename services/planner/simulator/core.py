"""What both simulated modes share (pure; no clock): simulated requests and their phase
timestamps, instance specs, the KV link, the event loop, continuous decode batching, and the
result with its attainment and per-phase breakdown."""

from __future__ import annotations

import collections
import functools
import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.planner.latency import PHASES, Contention, LatencyModel, Phase
from services.planner.noise import Jitter, Noise
from shared.metrics import SLO, attainment, tpot
from shared.workloads import Prefix, PrefixCaching, WorkloadRequest

NAN = math.nan


@dataclass
class SimRequest:
    rid: int
    arrival: float
    prompt: int
    output: int
    cached: int = 0  # prompt tokens a prefix cache holds: not computed (their KV is kept)
    prefill_start: float = NAN
    first_token: float = NAN
    transfer_start: float = NAN
    transfer_end: float = NAN
    decode_start: float = NAN
    finish: float = NAN
    instance: int = -1  # the colocated replica or prefill instance it went to (its index)
    # prompt tokens dispatch reckoned that instance computes (what it may hold left out), as
    # the gateway's ledger counts them until the first token
    reckoned: int = 0
    prefix: Prefix = ()  # its prompt's blocks, where instances cache them (`caching`)
    caching: PrefixCaching | None = None  # how; None: `cached` is as the workload says

    @property
    def done(self) -> bool:
        return not math.isnan(self.finish)

    @property
    def to_compute(self) -> int:
        """Its prompt tokens a prefill computes (those not cached)."""
        return self.prompt - self.cached

    @property
    def ttft(self) -> float | None:
        return None if not self.done else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        return None if not self.done else tpot(self.first_token, self.finish, self.output)


@dataclass(frozen=True)
class InstanceSpec:
    latency: LatencyModel
    kv_capacity: int  # token slots
    max_batch_tokens: int  # prefill: L_m; colocated: prefill (or chunk) budget per step
    max_batch: int = 256  # decode batch size cap
    node: int = 0
    # decode: a pull's blocks are taken at once, beside a step under way (one rank on the
    # CPU), not when that step ends (`Engine.blocks_off_thread`)
    pulls_mid_step: bool = False
    # how its steps' times scatter around its model's (none: each takes the model's time)
    noise: Noise = field(default_factory=Noise)


@dataclass(frozen=True)
class Link:
    kv_bytes_per_token: int
    intra_node_bps: float = 600e9
    inter_node_bps: float = 25e9

    def transfer_s(self, tokens: int, src: InstanceSpec, dst: InstanceSpec) -> float:
        bps = self.intra_node_bps if src.node == dst.node else self.inter_node_bps
        stages = min(src.latency.pp, dst.latency.pp)  # each stage moves its own layers
        return tokens * self.kv_bytes_per_token / bps / stages


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], Any]] = []
        self._seq = itertools.count()

    def at(self, time: float, fn: Callable[..., None], arg: Any = None) -> None:
        heapq.heappush(self._heap, (time, next(self._seq), fn, arg))

    def run(self) -> None:
        while self._heap:
            self.now, _, fn, arg = heapq.heappop(self._heap)
            fn(arg)

    @property
    def next_event(self) -> float:
        """When the next scheduled event happens (inf: none is)."""
        return self._heap[0][0] if self._heap else math.inf

    def skip_to(self, time: float) -> None:
        """Move the clock on to `time`, before anything scheduled happens (what happened
        meanwhile was worked out at once: `run_quiet_steps`)."""
        assert self.now <= time < self.next_event
        self.now = time


@dataclass(slots=True)
class _Running:
    """A step on a host: how much of it is left, in seconds alone, and at what slowdown it
    runs now (of the events scheduled for its instance, only the one of `version`, the
    host's count when it was last priced, ends it; the others are stale)."""

    phase: Phase
    by: dict[Phase, float]  # what a neighbour's step of each phase adds to its slowdown
    alone_s: float
    started: float
    done: Callable[[float], None]
    left_s: float
    factor: float = 0.0
    version: int = 0


class Host:
    """The devices of one host (a node), as the simulator runs their steps: each step runs
    at its latency model's speed slowed by the contention factor beside the steps the
    host's other devices run at the moment, and is priced again whenever one of them starts
    or ends (processor sharing: a 0.7 s prefill beside a neighbour's that starts halfway
    runs the second half slower, and both are slowed, not only the one that started last).
    Without contention (a profile that measured none, as on GPUs) every step takes its time
    alone and is scheduled once."""

    def __init__(self, loop: EventLoop) -> None:
        self.loop = loop
        self.running: dict[int, _Running] = {}  # id(instance) -> its step
        self.at = 0.0  # when the running steps' `left_s` were last brought up to date
        self.versions = itertools.count(1)
        self.ending = False  # in a step's end: steps started meanwhile are priced after it

    def run(self, instance: object, phase: Phase, latency: LatencyModel, seconds: float,
            done: Callable[[float], None]) -> None:
        """`instance` starts a step of `phase` that takes `seconds` alone; `done(stretch)`
        when it ends, with how many times its time alone it took."""
        assert id(instance) not in self.running, "one step at a time an instance"
        self._advance()
        self.running[id(instance)] = _Running(phase, added_by(latency.contention, phase),
                                               seconds, self.loop.now, done, seconds)
        if not self.ending:
            self._price()

    def paced_alone(self, contention: Contention) -> bool:
        """Whether a step of a device with `contention` started now runs at its pace alone,
        and leaves the running steps at theirs, until one of them ends or another starts:
        nothing runs here, or nothing here slows or is slowed by a neighbour's step."""
        return not self.running or (contention.none and not any(
            any(step.by.values()) for step in self.running.values()))

    def _advance(self) -> None:
        elapsed, self.at = self.loop.now - self.at, self.loop.now
        if elapsed > 0:
            for step in self.running.values():
                left = step.left_s - elapsed / step.factor
                step.left_s = left if left > 0.0 else 0.0

    def _price(self) -> None:
        """Each running step's slowdown beside the others; a step whose slowdown changed
        (or that has none yet) is scheduled to end anew."""
        running = list(self.running.items())  # a few: plain loops beat a generator's sum
        for key, step in running:
            added = 0.0
            for k, other in running:
                if k != key:
                    added += step.by[other.phase]
            factor = 1.0 + added
            if factor != step.factor:
                step.factor, step.version = factor, next(self.versions)
                self.loop.at(self.loop.now + step.left_s * factor, self._end,
                             (key, step.version))

    def _end(self, item: tuple[int, int]) -> None:
        key, version = item
        step = self.running.get(key)
        if step is None or step.version != version:
            return  # priced again since
        self._advance()
        del self.running[key]
        took = self.loop.now - step.started
        self.ending = True  # a next step started at once leaves its neighbours' pace as is
        try:
            step.done(took / step.alone_s if step.alone_s > 0 else 1.0)
        finally:
            self.ending = False
        self._price()


@functools.cache
def added_by(contention: Contention, phase: Phase) -> dict[Phase, float]:
    """What a neighbour's step of each phase adds to a `phase` step's slowdown. Shared: not
    to be changed."""
    return {other: contention.factor(phase, [other]) - 1.0 for other in PHASES}


def hosts(loop: EventLoop) -> collections.defaultdict[int, Host]:
    """One simulation's hosts by node, made as instances name them."""
    return collections.defaultdict(lambda: Host(loop))


class DecodeBatch:
    """Continuous decode batching shared by decode and colocated instances: requests finish
    after `output - 1` steps, found with a heap; the context sum grows by B per step."""

    def __init__(self) -> None:
        self.steps = 0
        self.sum_ctx = 0
        self.size = 0
        self._finishing: list[tuple[int, int, SimRequest]] = []

    def join(self, r: SimRequest) -> None:
        heapq.heappush(self._finishing, (self.steps + r.output - 1, r.rid, r))
        self.sum_ctx += r.prompt + 1
        self.size += 1

    @property
    def quiet_steps(self) -> int:
        """Steps from now in which no request finishes (a step only grows the contexts)."""
        return self._finishing[0][0] - self.steps - 1 if self._finishing else 0

    def skip(self, steps: int) -> None:
        """`steps` quiet steps taken at once."""
        assert 0 <= steps <= self.quiet_steps
        self.steps += steps
        self.sum_ctx += steps * self.size

    def advance(self, now: float) -> list[SimRequest]:
        self.steps += 1
        self.sum_ctx += self.size
        done = []
        while self._finishing and self._finishing[0][0] <= self.steps:
            r = heapq.heappop(self._finishing)[2]
            r.finish = now
            self.sum_ctx -= r.prompt + r.output
            self.size -= 1
            done.append(r)
        return done


def run_quiet_steps(loop: EventLoop, host: Host, batch: DecodeBatch,
                    latency: LatencyModel, jitter: Jitter | None = None) -> int:
    """Run at once the decode steps about to start that change nothing but the clock and
    the contexts, and return how many: those before the next one in which a request
    finishes that end before the next event (an arrival, a pull, a neighbour's step), where
    the host paces them as if alone (`Host.paced_alone`). The clock moves to the end of the
    last one. Each is timed as the step-by-step simulation times it (the same sums in the
    same order), so the results are the same to the bit; where requests decode for hundreds
    of steps between arrivals (the low rates a goodput search probes) it skips nearly all
    the events. With `jitter`, each step takes its model's time times its draw, drawn only
    for the steps run here."""
    if not host.paced_alone(latency.contention):
        return 0
    until, now, context, steps = loop.next_event, loop.now, batch.sum_ctx, 0
    for _ in range(batch.quiet_steps):
        seconds = latency.decode_step_s(batch.size, context)
        if jitter is not None:
            seconds *= jitter.peek()
        ends = now + seconds
        if ends >= until:  # an event at the same time ran first in the step-by-step run
            break
        if jitter is not None:
            jitter.take()
        now, context, steps = ends, context + batch.size, steps + 1
    if steps:
        batch.skip(steps)
        loop.skip_to(now)
    return steps


@dataclass
class SimResult:
    requests: list[SimRequest]
    devices: int = 1

    def attainment(self, slo: SLO) -> float:
        return attainment([r.ttft for r in self.requests], [r.tpot for r in self.requests], slo)

    def ttft_attainment(self, ttft_s: float) -> float:
        return sum(r.ttft is not None and r.ttft <= ttft_s for r in self.requests) / max(
            1, len(self.requests))

    @property
    def cached_share(self) -> float:
        """Of all prompt tokens, those found cached."""
        return sum(r.cached for r in self.requests) / max(
            1, sum(r.prompt for r in self.requests))

    def tpot_attainment(self, tpot_s: float) -> float:
        return sum(r.tpot is not None and r.tpot <= tpot_s for r in self.requests) / max(
            1, len(self.requests))

    def breakdown(self) -> dict[str, float]:
        """Mean seconds per phase over completed requests (the paper's Figure 10), cut
        where the services' spans cut them: the decode queue until the pull starts (room in
        the pool, and the step under way ended), the decode run from the KV's landing (so
        with the wait for the next step's start), as the decode service times both."""
        done = [r for r in self.requests if r.done]
        if not done:
            return {}

        def mean(values: Sequence[float]) -> float:
            finite = [v for v in values if not math.isnan(v)]
            return sum(finite) / len(finite) if finite else 0.0

        return {
            "prefill_queue": mean([r.prefill_start - r.arrival for r in done]),
            "prefill_run": mean([r.first_token - r.prefill_start for r in done]),
            "transfer": mean([r.transfer_end - r.transfer_start for r in done]),
            "decode_queue": mean([r.transfer_start - r.first_token for r in done]),
            "decode_run": mean([r.finish - r.transfer_end for r in done]),
        }


def sim_requests(workload: Sequence[WorkloadRequest]) -> list[SimRequest]:
    """The workload's requests to simulate; a prompt's cached tokens are all but its last at
    most (an engine computes that one whatever it holds, and samples from it), and where
    instances cache its prefix, what the one it goes to holds (`PrefixCaches`)."""
    return [SimRequest(i, w.arrival_s, w.prompt_tokens, w.output_tokens,
                       max(0, min(w.cached_tokens, w.prompt_tokens - 1)),
                       prefix=w.prefix, caching=w.caching if w.prefix else None)
            for i, w in enumerate(workload)]


