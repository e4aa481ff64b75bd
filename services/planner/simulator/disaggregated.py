"""The disaggregated cluster, simulated: requests go to the prefill instance with the shortest
queue (or to the one their prompt's start went to, where that saves time: prefixes.py; FCFS,
batches up to L_m tokens), which holds their KV until the least-loaded decode instance pulls
it (the prefill memory is the queue buffer; pulling needs room in the decode pool and batch);
the transfer takes KV bytes / link bandwidth; decode runs continuous batching. As the decode
service does, a decode instance takes the blocks for a pull at once where its engine allows it
(one rank on the CPU: `InstanceSpec.pulls_mid_step`), else between its steps (an
announcement heard mid-step starts its pull when that step ends), and a pulled request joins
at the next step's start: one heard mid-step joins the next step if its pull lands before
that step starts, or else the step after the one its pull overlaps. Also a decode instance
alone, fed as if prefill were instant (simu_decode)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.planner.latency import chunk_terms
from services.planner.noise import jitters
from services.planner.simulator.core import (
    DecodeBatch,
    EventLoop,
    Host,
    InstanceSpec,
    Link,
    SimRequest,
    SimResult,
    hosts,
    run_quiet_steps,
    sim_requests,
)
from services.planner.simulator.prefixes import PrefixCaches
from shared.workloads import WorkloadRequest


class PrefillInstance:
    def __init__(self, loop: EventLoop, spec: InstanceSpec,
                 on_prefilled: Callable[[SimRequest, PrefillInstance], None],
                 host: Host | None = None, index: int = 0) -> None:
        self.loop, self.spec, self.on_prefilled = loop, spec, on_prefilled
        self.host = host or Host(loop)
        draws = jitters(spec.noise, index)
        self.jitter = draws.get("prefill") if draws else None
        self.queue: deque[SimRequest] = deque()
        self.busy = False
        self.held = 0  # KV tokens of prefilled requests not yet pulled, plus the running batch
        self.pending = 0  # prompt tokens dispatch reckoned it computes (`reckoned`) for the
        # requests not yet past their first token

    @property
    def load(self) -> int:
        return len(self.queue) + self.busy

    def arrive(self, r: SimRequest) -> None:
        self.queue.append(r)
        self.pending += r.reckoned
        self._try_start()

    def release(self, r: SimRequest) -> None:
        self.held -= r.prompt
        self._try_start()

    def _try_start(self) -> None:
        if self.busy:
            return
        batch: list[SimRequest] = []
        total = held = 0  # new tokens (a cached prompt's are fewer), whole prompts
        while self.queue:
            r = self.queue[0]
            if batch and total + r.to_compute > self.spec.max_batch_tokens:
                break
            if self.held + held + r.prompt > self.spec.kv_capacity:
                break
            batch.append(self.queue.popleft())
            total, held = total + r.to_compute, held + r.prompt
        if not batch:
            return
        now, lat = self.loop.now, self.spec.latency
        for r in batch:
            r.prefill_start = now
        self.held += held
        self.busy = True
        terms = chunk_terms((r.to_compute, r.cached) for r in batch)
        stage_s, latency_s = lat.prefill_stage_s(*terms), lat.prefill_latency_s(*terms)
        if self.jitter is not None:
            factor = self.jitter.take()
            stage_s, latency_s = stage_s * factor, latency_s * factor

        def stage_free(stretch: float) -> None:  # the later stages run at its pace
            self.loop.at(self.loop.now + (latency_s - stage_s) * stretch, self._done, batch)
            self.busy = False
            self._try_start()

        self.host.run(self, "prefill", lat, stage_s, stage_free)

    def _done(self, batch: list[SimRequest]) -> None:
        for r in batch:
            r.first_token = self.loop.now
            self.pending -= r.reckoned
            self.on_prefilled(r, self)


class DecodeInstance:
    def __init__(self, loop: EventLoop, spec: InstanceSpec, link: Link | None,
                 host: Host | None = None, index: int = 0) -> None:
        self.loop, self.spec, self.link = loop, spec, link
        self.host = host or Host(loop)
        draws = jitters(spec.noise, index)
        self.jitter = draws.get("decode") if draws else None
        self.pending: deque[tuple[SimRequest, PrefillInstance | None]] = deque()
        self.joining: list[SimRequest] = []
        self.batch = DecodeBatch()
        self.in_transfer = 0
        self.reserved = 0
        self.stepping = False

    @property
    def load(self) -> int:
        return self.batch.size + len(self.pending) + len(self.joining) + self.in_transfer

    def enqueue(self, r: SimRequest, src: PrefillInstance | None) -> None:
        self.pending.append((r, src))
        if self.spec.pulls_mid_step or not self.stepping:  # else when the step ends
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
                self.link.transfer_s(r.to_compute, src.spec, self.spec)
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
            lat = self.spec.latency
            run_quiet_steps(self.loop, self.host, self.batch, lat, self.jitter)
            step = lat.decode_step_s(self.batch.size, self.batch.sum_ctx)
            if self.jitter is not None:
                step *= self.jitter.take()
            self.host.run(self, "decode", lat, step, self._step_done)

    def _step_done(self, _: float) -> None:
        for r in self.batch.advance(self.loop.now):
            self.reserved -= r.prompt + r.output
        self._try_pull()
        self._start_step()


@dataclass(frozen=True)
class DisaggregatedCluster:
    prefill: list[InstanceSpec]
    decode: list[InstanceSpec]
    link: Link
    devices: int = 0


def simulate_disaggregated(cluster: DisaggregatedCluster,
                           workload: Sequence[WorkloadRequest]) -> SimResult:
    loop = EventLoop()
    on = hosts(loop)
    # each instance's step noise its own (the n-th prefill's, decode's: 2n, 2n + 1)
    decodes = [DecodeInstance(loop, spec, cluster.link, on[spec.node], 2 * i + 1)
               for i, spec in enumerate(cluster.decode)]

    def prefilled(r: SimRequest, src: PrefillInstance) -> None:
        if r.output <= 1 or not decodes:  # done at the first token (or prefill-only study)
            r.finish = loop.now
            src.release(r)
            return
        min(decodes, key=lambda d: d.load).enqueue(r, src)

    prefills = [PrefillInstance(loop, spec, prefilled, on[spec.node], 2 * i)
                for i, spec in enumerate(cluster.prefill)]
    caches = PrefixCaches(cluster.prefill)

    def dispatch(r: SimRequest) -> None:  # as the gateway does (shared.state.pick_prefill)
        r.instance = caches.dispatch(r, lambda holder: min(
            range(len(prefills)), key=lambda i: (prefills[i].load, i != holder, i)),
            lambda i: prefills[i].pending)
        caches.take(r, r.instance)
        prefills[r.instance].arrive(r)

    requests = sim_requests(workload)
    for r in requests:
        loop.at(r.arrival, dispatch, r)
    loop.run()
    return SimResult(requests, cluster.devices)


def simulate_decode_only(spec: InstanceSpec, workload: Sequence[WorkloadRequest]) -> SimResult:
    """A decode instance fed as if prefill were instant (the paper's simu_decode)."""
    loop = EventLoop()
    decode = DecodeInstance(loop, spec, None)
    requests = sim_requests(workload)

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
