"""The pure scheduler: which requests compute how many tokens in the next step.

One rule covers every role: a scheduled request computes tokens [num_computed, num_computed +
length) and samples the next token when that reaches its end. A decode step is the case
length == 1; a chunked prefill is a prefill whose length is cut by the token budget.

- prefill role: batch waiting prompts up to the token budget (L_m); after the first token a
  request is parked, keeping its blocks until `release` (a decode instance pulled them).
- decode role: `add_prefilled` admits requests whose KV was imported; continuous batching.
- colocated: new prefills and running decodes over one pool, vLLM-style (a step of prefills
  when any can be admitted, otherwise a decode step) or, with chunked prefill, Sarathi-style
  (running decodes first, then prefill chunks filling the rest of the token budget).

When the pool runs out the newest running request (of those not in a step under way) is
preempted by recompute: its blocks are freed and it goes back to the head of the queue, to
be prefilled again over all its tokens.

With prefix caching a request admitted takes the blocks of its leading tokens that the pool
holds already (computed for an earlier request; block_manager.py) and computes the rest: at
least its last token, whose logits it samples from. Every block a step fills is registered
for those after it. A request that scores its prompt computes all of it.

With `micro_batches` > 1 (a pipeline of that many stages) several steps are under way at
once: a request in one (`in_step`, until its update) is left out of the next, and a step
decodes at most its share of the running requests, so the steps in flight split them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from shared.engine.block_manager import BlockManager, blocks_for, chain_hashes
from shared.engine.config import Role, SchedulerConfig
from shared.engine.request import Draw, Request, RequestStatus


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int  # request.num_computed when scheduled
    length: int  # tokens computed this step

    @property
    def samples(self) -> bool:
        return self.start + self.length == self.request.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    prefills: list[ScheduledChunk]  # more than one new token each, computed first
    decodes: list[ScheduledChunk]  # one new token each, batched after the prefills
    preempted: list[Request] = field(default_factory=list)

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.prefills + self.decodes

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.chunks)

    def shape(self) -> StepShape | None:
        """What the latency model prices the step by: the prompt chunks it computes (each
        one's tokens, and how many of its tokens were computed before) and the decodes
        beside them; None for a step that computes nothing."""
        if not self.prefills and not self.decodes:
            return None
        done = tuple(c.start for c in self.prefills)
        return StepShape(tuple(c.length for c in self.prefills), len(self.decodes),
                         sum(c.start + 1 for c in self.decodes), done if any(done) else ())


@dataclass(frozen=True)
class StepShape:
    """A step as the latency model prices it: whole prompts (a prefill step), a batch of
    decodes (a decode step), or prompt chunks with decodes riding along (a chunked step, a
    failover's replay beside decodes)."""

    prompts: tuple[int, ...]  # tokens of each prompt computed in the step
    batch: int  # requests decoded
    context: int  # their tokens attended to, summed
    done: tuple[int, ...] = ()  # each prompt's tokens computed before (): all 0, whole prompts


Sampled = Mapping[str, Draw]  # request id -> its token, logprob and the top ones


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager,
                 micro_batches: int = 1) -> None:
        assert blocks.block_size == config.block_size and micro_batches >= 1
        self.config = config
        self.blocks = blocks
        self.micro_batches = micro_batches
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.parked: dict[str, Request] = {}
        self._requests: dict[str, Request] = {}
        # prefix caching, summed over the requests admitted that could use it: their tokens,
        # and those found in the pool (a decode role's: of the KV it imports, the tokens
        # whose blocks it held, not pulled; Engine.allocate_for)
        self.prefix_queried = 0
        self.prefix_hits = 0

    # -- admission -----------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a request for prefill (a new prompt, or a request to recompute)."""
        assert request.request_id not in self._requests, f"duplicate id {request.request_id}"
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        self.waiting.append(request)

    def add_prefilled(self, request: Request) -> None:
        """Decode role: admit a request whose K/V of its first `num_computed` tokens already
        sit in its block table; more than one token left to compute (a failover's replay)
        are computed as a chunk in the next step."""
        assert 0 < request.num_computed < request.num_tokens, \
            (request.num_computed, request.num_tokens)
        assert request.num_computed <= len(request.block_table) * self.blocks.block_size
        self._requests[request.request_id] = request
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput | None:
        """The next step's chunks. The pool stays held while they are chosen: a pull taking
        blocks off the steps' thread waits for the choice (not for the step), so no block a
        preemption frees for an older request, nor the admission watermark, goes to it."""
        with self.blocks.held():
            if self.config.chunked_prefill:
                out = self._schedule_mixed()
            else:
                preempted: list[Request] = []
                prefills = self._admit(self.config.max_batch_tokens, chunk=False)
                decodes: list[ScheduledChunk] = []
                if not prefills:  # decodes, with replays (only a decode role has them)
                    decodes = self._schedule_decodes(preempted)
                    prefills = self._continue(self.config.max_batch_tokens - len(decodes))
                out = SchedulerOutput(prefills, decodes, preempted)
        for chunk in out.chunks:
            chunk.request.in_step = True
        return out if out.chunks else None

    def _schedule_mixed(self) -> SchedulerOutput:
        preempted: list[Request] = []
        decodes = self._schedule_decodes(preempted)
        budget = self.config.max_batch_tokens - len(decodes)
        prefills = self._continue(budget)
        budget -= sum(c.length for c in prefills)
        prefills += self._admit(budget, chunk=True)
        return SchedulerOutput(prefills, decodes, preempted)

    def _continue(self, budget: int) -> list[ScheduledChunk]:
        """Chunks for running requests with more than one token to compute (a chunked
        prefill, or a failover's replay), oldest first, within the token budget."""
        chunks = []
        for request in [r for r in self.running
                        if r.num_tokens - r.num_computed > 1 and not r.in_step]:
            if budget <= 0:
                break
            chunk = self._chunk(request, budget)
            if chunk is None:
                break
            chunks.append(chunk)
            budget -= chunk.length
        return chunks

    def _admit(self, budget: int, chunk: bool) -> list[ScheduledChunk]:
        """Move waiting requests to running, FCFS, within the token budget and the pool.
        Without chunking the first request goes even if it alone exceeds the budget."""
        admitted: list[ScheduledChunk] = []
        cap = self.config.max_running
        while self.waiting and len(self.running) < cap and budget > 0:
            request = self.waiting[0]
            looks = self.caches(request)
            hit, revived = self._cached_prefix(request) if looks else (0, 0)  # found, free
            start = max(request.num_computed, hit * self.blocks.block_size)
            remaining = request.num_tokens - start
            length = min(remaining, budget) if chunk else remaining
            if length > budget and admitted:
                break
            reserve = self.config.watermark_blocks if self.running else 0
            needed = blocks_for(start + length, self.blocks.block_size)
            held = max(len(request.block_table), hit)
            if not self.blocks.can_allocate(needed - held + revived + reserve):
                break
            if hit:
                request.block_table = self.blocks.take_cached(request.block_hashes[:hit])
                assert len(request.block_table) == hit  # the pool is held: none went since
                request.num_computed = start
                request.num_registered = hit
            if looks:
                request.cached_tokens = hit * self.blocks.block_size
            if looks and not request.output_ids:  # a new prompt (not a recompute)
                self.prefix_queried += request.num_tokens
                self.prefix_hits += request.cached_tokens
            self.blocks.grow(request.block_table, start + length)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            admitted.append(ScheduledChunk(request, request.num_computed, length))
            budget -= length
        return admitted

    def caches(self, request: Request) -> bool:
        """Whether an admission of `request` looks for its prefix in the pool: not for a
        prompt to score before its first token (every token's logits wanted)."""
        return self.config.prefix_caching and request.num_computed == 0 and \
            not request.block_table and \
            not (request.params.prompt_logprobs and not request.output_ids)

    def _cached_prefix(self, request: Request) -> tuple[int, int]:
        """How many of a waiting request's leading blocks the pool holds (all but its
        last token at most), and how many of those are free."""
        hashes = self._hashes(request)
        return self.blocks.cached_run(hashes[:(request.num_tokens - 1) // self.blocks.block_size])

    def _hashes(self, request: Request) -> list[bytes]:
        """The hashes of the request's full blocks so far (computed once each)."""
        request.block_hashes = chain_hashes(request.all_ids, self.blocks.block_size,
                                            request.block_hashes, request.params.cache_salt)
        return request.block_hashes

    def _register(self, request: Request) -> None:
        """Register the blocks a step filled (with prefix caching)."""
        bs = self.blocks.block_size
        full = min(request.num_computed // bs, len(request.block_table))
        if not self.config.prefix_caching or full <= request.num_registered:
            return
        hashes = self._hashes(request)
        for i in range(request.num_registered, full):
            self.blocks.register(request.block_table[i], hashes[i])
        request.num_registered = full

    def _chunk(self, request: Request, budget: int) -> ScheduledChunk | None:
        length = min(request.num_tokens - request.num_computed, budget)
        if not self.blocks.grow(request.block_table, request.num_computed + length):
            return None
        return ScheduledChunk(request, request.num_computed, length)

    def _schedule_decodes(self, preempted: list[Request]) -> list[ScheduledChunk]:
        """One token for every running decode not in a step under way (at most its share of
        them, with micro-batches), oldest first; the newest are preempted when the pool
        cannot hold the next token of an older one."""
        decoding = [r for r in self.running if r.num_tokens - r.num_computed == 1]
        share = -(-len(decoding) // self.micro_batches)
        queue = sorted((r for r in decoding if not r.in_step), key=lambda r: r.arrival)
        scheduled: list[ScheduledChunk] = []
        while queue and len(scheduled) < share:
            request = queue.pop(0)
            while not self.blocks.grow(request.block_table, request.num_tokens):
                victim = queue.pop() if queue else request
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append(ScheduledChunk(request, request.num_computed, 1))
        return scheduled

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.blocks.free(request.block_table)
        request.block_table = []
        request.num_computed = request.num_registered = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    # -- after the step ------------------------------------------------------------------

    def update(self, out: SchedulerOutput, sampled: Sampled) -> list[Request]:
        """Advance the scheduled requests; return those that finished this step."""
        finished = []
        for chunk in out.chunks:
            request = chunk.request
            request.in_step = False
            if request.status is not RequestStatus.RUNNING:  # aborted during the step
                continue
            request.num_computed += chunk.length
            self._register(request)
            if not chunk.samples:
                continue
            request.append(*sampled[request.request_id])
            if request.status.finished:
                self._drop(request)
                finished.append(request)
            elif self.config.role is Role.PREFILL:
                self.running.remove(request)
                request.status = RequestStatus.PARKED
                self.parked[request.request_id] = request
        return finished

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request early (a stop string, an abort) and free its blocks."""
        assert status.finished
        request.status = status
        self._drop(request)

    def abort(self, request_id: str) -> Request | None:
        request = self._requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def release(self, request_id: str) -> Request | None:
        """Prefill role: a decode instance has pulled the blocks; free them."""
        request = self.parked.get(request_id)
        if request is not None:
            self._drop(request)
        return request

    def _drop(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.parked.pop(request.request_id, None)
        self._requests.pop(request.request_id, None)
        self.blocks.free(request.block_table)
        request.block_table = []
