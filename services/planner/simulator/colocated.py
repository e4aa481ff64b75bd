"""The colocated cluster, simulated: every instance runs both phases on its device, and each
request goes to the least-loaded instance (or to the one its prompt's start went to, where
that saves time: prefixes.py). KV memory is reserved for a request's prompt and output when
it is admitted, so the simulated engines never preempt. Two schedulers:

- `PrefillFirstInstance` (vLLM's default): a prefill-only step whenever prompts can be
  admitted (up to L_m tokens together), else a decode step of the running batch;
- `ChunkedInstance` (chunked prefill): every step runs the running decodes plus chunks of
  the admitted prompts, within a token budget: priced as the prompt chunks' prefill (a
  chunk continuing a prompt attending to its cached tokens too) plus what the decodes add
  to it (`LatencyModel.riding_ms`), or as a decode step when no prompt
  is in it."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.planner.latency import Phase, chunk_terms
from services.planner.noise import Jitters, jitters
from services.planner.simulator.core import (
    DecodeBatch,
    EventLoop,
    Host,
    InstanceSpec,
    SimRequest,
    SimResult,
    hosts,
    run_quiet_steps,
    sim_requests,
)
from services.planner.simulator.prefixes import PrefixCaches
from shared.state import colocated_key
from shared.workloads import WorkloadRequest


@dataclass
class Prefilling:
    request: SimRequest
    done: int = 0  # prompt tokens computed so far (or found in a prefix cache)


Chunk = tuple[Prefilling, int]  # a prompt and how many of its tokens a step computes


@dataclass
class ColocatedInstance:
    """What both schedulers share: the queue, admission against the batch and KV limits,
    and what a finished step does. A scheduler plans each step (`_plan`)."""

    loop: EventLoop
    spec: InstanceSpec
    host: Host
    waiting: deque[SimRequest] = field(default_factory=deque)
    prefilling: list[Prefilling] = field(default_factory=list)
    batch: DecodeBatch = field(default_factory=DecodeBatch)
    reserved: int = 0
    busy: bool = False
    jitter: Jitters | None = None  # its steps' draws by phase (None: each as its model says)

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.prefilling) + self.batch.size

    @property
    def queued(self) -> int:
        """Its requests not yet past their first token."""
        return len(self.waiting) + len(self.prefilling)

    @property
    def pending(self) -> int:
        """The prompt tokens dispatch reckoned it computes for those (`reckoned`)."""
        return sum(r.reckoned for r in self.waiting) + \
            sum(p.request.reckoned for p in self.prefilling)

    def arrive(self, r: SimRequest) -> None:
        self.waiting.append(r)
        if not self.busy:
            self._step()

    def _prompt_tokens_left(self) -> int:
        return sum(p.request.prompt - p.done for p in self.prefilling)

    def _fits(self, r: SimRequest) -> bool:
        return self.batch.size + len(self.prefilling) < self.spec.max_batch and \
            self.reserved + r.prompt + r.output <= self.spec.kv_capacity

    def _admit_next(self) -> None:  # (a prompt's cached tokens are done from the start)
        r = self.waiting.popleft()
        r.prefill_start = self.loop.now
        self.reserved += r.prompt + r.output
        self.prefilling.append(Prefilling(r, r.cached))

    def _plan(self) -> tuple[float, list[Chunk], bool] | None:
        """The next step: its seconds, the prompt chunks it computes, whether it decodes the
        running batch; None when there is nothing to run."""
        raise NotImplementedError

    def _step(self) -> None:
        planned = self._plan()
        self.busy = planned is not None
        if planned is not None:
            seconds, chunks, decoding = planned
            lat = self.spec.latency
            # with no prompt in hand (none admitted, the next not fitting), a decode step is
            # planned again and again until an arrival or a finish
            phase: Phase = "prefill" if chunks else "decode"
            jitter = self.jitter.get(phase) if self.jitter else None
            if not chunks and not self.prefilling and \
                    run_quiet_steps(self.loop, self.host, self.batch, lat, jitter):
                seconds = lat.decode_step_s(self.batch.size, self.batch.sum_ctx)
            if jitter is not None:
                seconds *= jitter.take()
            self.host.run(self, phase, lat, seconds,
                          lambda _: self._step_done(chunks, decoding))

    def _step_done(self, chunks: list[Chunk], decoding: bool) -> None:
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


class PrefillFirstInstance(ColocatedInstance):
    def _plan(self) -> tuple[float, list[Chunk], bool] | None:
        budget = self.spec.max_batch_tokens
        while self.waiting and self._fits(self.waiting[0]) and not (
                self.prefilling and
                self._prompt_tokens_left() + self.waiting[0].to_compute > budget):
            self._admit_next()
        lat = self.spec.latency
        if self.prefilling:  # whole prompts (but their cached tokens), no decoding in the step
            chunks = [(p, p.request.prompt - p.done) for p in self.prefilling]
            seconds = lat.prefill_latency_s(*chunk_terms((n, p.done) for p, n in chunks))
            return seconds, chunks, False
        if self.batch.size:
            return lat.decode_step_s(self.batch.size, self.batch.sum_ctx), [], True
        return None


class ChunkedInstance(ColocatedInstance):
    def _plan(self) -> tuple[float, list[Chunk], bool] | None:
        budget = max(0, self.spec.max_batch_tokens - self.batch.size)  # decodes count first
        while self.waiting and self._fits(self.waiting[0]):
            enough = self._prompt_tokens_left() + self.waiting[0].to_compute >= budget
            self._admit_next()
            if enough:
                break
        if not self.prefilling and not self.batch.size:
            return None
        chunks, left = [], budget
        for p in self.prefilling:
            take = min(left, p.request.prompt - p.done)
            if take <= 0:
                break
            if p.done == p.request.cached:  # its queue ends at its first chunk, as the
                # worker's span does
                p.request.prefill_start = self.loop.now
            chunks.append((p, take))
            left -= take
        lat = self.spec.latency
        if not chunks:  # the engine runs it as any decode step
            return lat.decode_step_s(self.batch.size, self.batch.sum_ctx), [], True
        riding = lat.riding_ms(self.batch.size, self.batch.sum_ctx)
        terms = chunk_terms((n, p.done) for p, n in chunks)
        seconds = (lat.prefill_ms(*terms) + riding) / lat.pp / 1e3
        return seconds, chunks, self.batch.size > 0


@dataclass(frozen=True)
class ColocatedCluster:
    instances: list[InstanceSpec]
    chunked: bool = False
    devices: int = 0


def simulate_colocated(cluster: ColocatedCluster,
                       workload: Sequence[WorkloadRequest]) -> SimResult:
    loop = EventLoop()
    on = hosts(loop)
    kind = ChunkedInstance if cluster.chunked else PrefillFirstInstance
    instances = [kind(loop, spec, on[spec.node], jitter=jitters(spec.noise, i))
                 for i, spec in enumerate(cluster.instances)]
    requests = sim_requests(workload)
    caches = PrefixCaches(cluster.instances)

    def dispatch(r: SimRequest) -> None:  # as the gateway does (shared.state.pick_colocated)
        r.instance = caches.dispatch(r, lambda holder: min(
            range(len(instances)), key=lambda i: colocated_key(
                instances[i].load, instances[i].queued, i, i == holder)),
            lambda i: instances[i].pending, lambda i: instances[i].load,
            lambda i: instances[i].load >= instances[i].spec.max_batch)
        caches.take(r, r.instance)
        instances[r.instance].arrive(r)

    for r in requests:
        loop.at(r.arrival, dispatch, r)
    loop.run()
    return SimResult(requests, cluster.devices)
