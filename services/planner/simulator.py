"""Discrete-event simulator of a disaggregated or a colocated cluster (pure; no clock).

Disaggregated: requests go to the prefill instance with the shortest queue (FCFS, batches up
to L_m tokens), which holds their KV until the least-loaded decode instance pulls it (the
prefill memory is the queue buffer; pulling needs room in the decode pool and batch); the
transfer takes KV bytes / link bandwidth; decode runs continuous batching. Colocated: vLLM-
style instances (a prefill step whenever prompts can be admitted, else a decode step), or
chunked prefill (running decodes plus prefill chunks within a token budget per step).
KV memory is reserved for a request's prompt + output when it is admitted, so the simulated
engines never preempt.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.planner.latency import LatencyModel
from shared.metrics import SLO, attainment, tpot
from shared.workloads import WorkloadRequest

NAN = math.nan


@dataclass
class SimRequest:
    rid: int
    arrival: float
    prompt: int
    output: int
    prefill_start: float = NAN
    first_token: float = NAN
    transfer_start: float = NAN
    transfer_end: float = NAN
    decode_start: float = NAN
    finish: float = NAN

    @property
    def done(self) -> bool:
        return not math.isnan(self.finish)

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


class _Batcher:
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


class PrefillInstance:
    def __init__(self, loop: EventLoop, spec: InstanceSpec,
                 on_prefilled: Callable[[SimRequest, PrefillInstance], None]) -> None:
        self.loop, self.spec, self.on_prefilled = loop, spec, on_prefilled
        self.queue: deque[SimRequest] = deque()
        self.busy = False
        self.held = 0  # KV tokens of prefilled requests not yet pulled, plus the running batch

    @property
    def load(self) -> int:
        return len(self.queue) + self.busy

    def arrive(self, r: SimRequest) -> None:
        self.queue.append(r)
        self._try_start()

    def release(self, r: SimRequest) -> None:
        self.held -= r.prompt
        self._try_start()

    def _try_start(self) -> None:
        if self.busy:
            return
        batch: list[SimRequest] = []
        total = squares = 0
        while self.queue:
            p = self.queue[0].prompt
            if batch and total + p > self.spec.max_batch_tokens:
                break
            if self.held + total + p > self.spec.kv_capacity:
                break
            batch.append(self.queue.popleft())
            total, squares = total + p, squares + p * p
        if not batch:
            return
        now, lat = self.loop.now, self.spec.latency
        for r in batch:
            r.prefill_start = now
        self.held += total
        self.busy = True
        self.loop.at(now + lat.prefill_stage_s(total, squares), self._stage_free)
        self.loop.at(now + lat.prefill_latency_s(total, squares), self._done, batch)

    def _stage_free(self, _: None) -> None:
        self.busy = False
        self._try_start()

    def _done(self, batch: list[SimRequest]) -> None:
        for r in batch:
            r.first_token = self.loop.now
            self.on_prefilled(r, self)


class DecodeInstance:
    def __init__(self, loop: EventLoop, spec: InstanceSpec, link: Link | None) -> None:
        self.loop, self.spec, self.link = loop, spec, link
        self.pending: deque[tuple[SimRequest, PrefillInstance | None]] = deque()
        self.joining: list[SimRequest] = []
        self.batch = _Batcher()
        self.in_transfer = 0
        self.reserved = 0
        self.stepping = False

    @property
    def load(self) -> int:
        return self.batch.size + len(self.pending) + len(self.joining) + self.in_transfer

    def enqueue(self, r: SimRequest, src: PrefillInstance | None) -> None:
        self.pending.append((r, src))
        self._try_pull()

    def _try_pull(self) -> None:
        while self.pending:
            r, src = self.pending[0]
            need = r.prompt + r.output
            active = self.batch.size + len(self.joining) + self.in_transfer
            if active >= self.spec.max_batch or self.reserved + need > self.spec.kv_capacity:
                return
            self.pending.popleft()
            self.reserved += need
            self.in_transfer += 1
            r.transfer_start = self.loop.now
            seconds = 0.0 if src is None or self.link is None else \
                self.link.transfer_s(r.prompt, src.spec, self.spec)
            self.loop.at(self.loop.now + seconds, self._pulled, (r, src))

    def _pulled(self, item: tuple[SimRequest, PrefillInstance | None]) -> None:
        r, src = item
        self.in_transfer -= 1
        r.transfer_end = self.loop.now
        if src is not None:
            src.release(r)
        self.joining.append(r)
        if not self.stepping:
            self._start_step()

    def _start_step(self) -> None:
        for r in self.joining:
            r.decode_start = self.loop.now
            self.batch.join(r)
        self.joining.clear()
        self.stepping = self.batch.size > 0
        if self.stepping:
            step = self.spec.latency.decode_step_s(self.batch.size, self.batch.sum_ctx)
            self.loop.at(self.loop.now + step, self._step_done)

    def _step_done(self, _: None) -> None:
        for r in self.batch.advance(self.loop.now):
            self.reserved -= r.prompt + r.output
        self._try_pull()
        self._start_step()


@dataclass
class SimResult:
    requests: list[SimRequest]
    devices: int = 1

    def attainment(self, slo: SLO) -> float:
        return attainment([r.ttft for r in self.requests], [r.tpot for r in self.requests], slo)

    def ttft_attainment(self, ttft_s: float) -> float:
        return sum(r.ttft is not None and r.ttft <= ttft_s for r in self.requests) / max(
            1, len(self.requests))

    def tpot_attainment(self, tpot_s: float) -> float:
        return sum(r.tpot is not None and r.tpot <= tpot_s for r in self.requests) / max(
            1, len(self.requests))

    def breakdown(self) -> dict[str, float]:
        """Mean seconds per phase over completed requests (the paper's Figure 10)."""
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
            "decode_queue": mean([(r.transfer_start - r.first_token) +
                                  (r.decode_start - r.transfer_end) for r in done]),
            "decode_run": mean([r.finish - r.decode_start for r in done]),
        }


def _sim_requests(workload: Sequence[WorkloadRequest]) -> list[SimRequest]:
    return [SimRequest(i, w.arrival_s, w.prompt_tokens, w.output_tokens)
            for i, w in enumerate(workload)]


@dataclass(frozen=True)
class DisaggregatedCluster:
    prefill: list[InstanceSpec]
    decode: list[InstanceSpec]
    link: Link
    devices: int = 0


def simulate_disaggregated(cluster: DisaggregatedCluster,
                           workload: Sequence[WorkloadRequest]) -> SimResult:
    loop = EventLoop()
    decodes = [DecodeInstance(loop, spec, cluster.link) for spec in cluster.decode]

    def prefilled(r: SimRequest, src: PrefillInstance) -> None:
        if r.output <= 1 or not decodes:  # done at the first token (or prefill-only study)
            r.finish = loop.now
            src.release(r)
            return
        min(decodes, key=lambda d: d.load).enqueue(r, src)

    prefills = [PrefillInstance(loop, spec, prefilled) for spec in cluster.prefill]
    requests = _sim_requests(workload)
    for r in requests:
        loop.at(r.arrival, lambda r: min(prefills, key=lambda p: p.load).arrive(r), r)
    loop.run()
    return SimResult(requests, cluster.devices)


def simulate_decode_only(spec: InstanceSpec, workload: Sequence[WorkloadRequest]) -> SimResult:
    """A decode instance fed as if prefill were instant (the paper's simu_decode)."""
    loop = EventLoop()
    decode = DecodeInstance(loop, spec, None)
    requests = _sim_requests(workload)

    def arrive(r: SimRequest) -> None:
        r.prefill_start = r.first_token = loop.now
        if r.output <= 1:
            r.finish = loop.now
        else:
            decode.enqueue(r, None)

    for r in requests:
        loop.at(r.arrival, arrive, r)
    loop.run()
    return SimResult(requests)


@dataclass
class _Prefilling:
    request: SimRequest
    done: int = 0  # prompt tokens computed so far (chunked prefill)


@dataclass
class ColocatedInstance:
    loop: EventLoop
    spec: InstanceSpec
    chunked: bool
    waiting: deque[SimRequest] = field(default_factory=deque)
    prefilling: list[_Prefilling] = field(default_factory=list)
    batch: _Batcher = field(default_factory=_Batcher)
    reserved: int = 0
    busy: bool = False

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.prefilling) + self.batch.size

    def arrive(self, r: SimRequest) -> None:
        self.waiting.append(r)
        if not self.busy:
            self._step()

    def _admit(self, budget: int) -> None:
        while self.waiting:
            r = self.waiting[0]
            used = sum(p.request.prompt - p.done for p in self.prefilling)
            active = self.batch.size + len(self.prefilling)
            if (self.prefilling and not self.chunked and used + r.prompt > budget) \
                    or active >= self.spec.max_batch \
                    or self.reserved + r.prompt + r.output > self.spec.kv_capacity:
                return
            self.waiting.popleft()
            r.prefill_start = self.loop.now
            self.reserved += r.prompt + r.output
            self.prefilling.append(_Prefilling(r))
            if self.chunked and used + r.prompt >= budget:
                return

    def _step(self) -> None:
        budget = self.spec.max_batch_tokens
        if self.chunked:
            budget = max(0, budget - self.batch.size)
        self._admit(budget)
        lat = self.spec.latency
        if self.prefilling and not self.chunked:  # vLLM: a prefill-only step
            lengths = [p.request.prompt for p in self.prefilling]
            seconds = lat.prefill_latency_s(sum(lengths), sum(n * n for n in lengths))
            chunks = [(p, p.request.prompt) for p in self.prefilling]
            decoding = False
        elif self.chunked and (self.prefilling or self.batch.size):
            chunks, left = [], budget
            for p in self.prefilling:
                take = min(left, p.request.prompt - p.done)
                if take <= 0:
                    break
                chunks.append((p, take))
                left -= take
            tokens = sum(n for _, n in chunks) + self.batch.size
            squares = sum(n * (p.done + n) for p, n in chunks)
            attention = lat.coefficients.decode_small[1] * self.batch.sum_ctx
            seconds = (lat.prefill_ms(tokens, squares) + attention) / lat.pp / 1e3
            decoding = self.batch.size > 0
        elif self.batch.size:
            chunks, decoding = [], True
            seconds = lat.decode_step_s(self.batch.size, self.batch.sum_ctx)
        else:
            self.busy = False
            return
        self.busy = True
        self.loop.at(self.loop.now + seconds, self._step_done, (chunks, decoding))

    def _step_done(self, item: tuple[list[tuple[_Prefilling, int]], bool]) -> None:
        chunks, decoding = item
        if decoding:
            for r in self.batch.advance(self.loop.now):
                self.reserved -= r.prompt + r.output
        for p, n in chunks:
            p.done += n
            if p.done == p.request.prompt:
                self.prefilling.remove(p)
                r = p.request
                r.first_token = r.transfer_start = r.transfer_end = r.decode_start = self.loop.now
                if r.output <= 1:
                    r.finish = self.loop.now
                    self.reserved -= r.prompt + r.output
                else:
                    self.batch.join(r)
        self._step()


@dataclass(frozen=True)
class ColocatedCluster:
    instances: list[InstanceSpec]
    chunked: bool = False
    devices: int = 0


def simulate_colocated(cluster: ColocatedCluster,
                       workload: Sequence[WorkloadRequest]) -> SimResult:
    loop = EventLoop()
    instances = [ColocatedInstance(loop, spec, cluster.chunked) for spec in cluster.instances]
    requests = _sim_requests(workload)
    for r in requests:
        loop.at(r.arrival, lambda r: min(instances, key=lambda i: i.load).arrive(r), r)
    loop.run()
    return SimResult(requests, cluster.devices)
