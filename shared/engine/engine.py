"""The engine loop: schedule, execute, update. Streaming text, stop strings and KV export /
import wrap it; they do not live inside it."""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import logging
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from shared.engine.block_manager import BlockHash, BlockManager, blocks_for, chain_hashes
from shared.engine.config import EngineConfig, ModelConfig
from shared.engine.kv_cache import Alloc
from shared.engine.loader import LoadedModel
from shared.engine.model_runner import Launched, ModelRunner
from shared.engine.parallel.group import Command, RankFailed, text_payload
from shared.engine.parallel.kv_serving import KvPull
from shared.engine.parallel.layout import KvSpan
from shared.engine.request import Draw, Request, RequestStatus, SamplingParams, TopLogprobs
from shared.engine.scheduler import Sampled, Scheduler, SchedulerOutput, StepShape
from shared.engine.structured import Guides
from shared.engine.tokenizer import IncrementalDetokenizer, TextTokenizer

log = logging.getLogger(__name__)


class RequestRejected(ValueError):
    """The request can never run on this engine (empty, too long for the context or pool)."""


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finish_reason: str | None = None  # "stop", "length", "abort" once finished
    parked: bool = False  # prefill role: first token sampled, KV ready to be pulled
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)  # where asked for
    prompt_logprobs: list[Draw] = field(default_factory=list)  # with the first token's
    error: str | None = None  # the step failed: the request was aborted, its blocks freed
    index: int = 0  # output index of the first new token (without tokens: outputs so far)
    arrival: int = -1  # the request's admission number here: which copy of a request id
    tag: int = 0  # the copy's `Request.tag` (a worker's attempt: what the output belongs to)
    refused: bool = False  # with `error`: the request's own doing (its format), not the engine's
    cached_tokens: int = 0  # with the first token: the prompt's tokens found in the KV pool

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


def _began(out: SchedulerOutput | None) -> list[tuple[str, int]]:
    """The requests whose prompt `out` begins computing, and which copy of each."""
    return [] if out is None else [(c.request.request_id, c.request.arrival)
                                   for c in out.prefills if c.start == 0]


class TextState:
    """Per-request detokenization; holds back text that may be the start of a stop string.
    `streamed`: the tokens a request resumed here had streamed elsewhere; their text, as
    that stream showed it, is not shown again. `prompt`: what the output is decoded after
    (TextTokenizer.context_of)."""

    def __init__(self, tokenizer: TextTokenizer, stop: tuple[str, ...],
                 streamed: Sequence[int] = (), prompt: Sequence[int] = ()) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, tokenizer.context_of(prompt))
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.sent = 0
        self.searched = 0  # the text searched for stop strings so far (none was in it)
        self.detok.streamed(streamed)
        self.advance(streamed)  # nothing more to decode: what the stream held back for stops

    def advance(self, ids: Sequence[int]) -> tuple[str, bool]:
        """(new text to emit, whether a stop string was hit). Only the new text, and the
        stop strings' length before it, is searched: a token costs the same late in a long
        generation as early."""
        self.detok.update(ids)
        text = self.detok.text
        hits = [at for s in self.stop
                if (at := text.find(s, max(0, self.searched - len(s) + 1))) >= 0]
        self.searched = len(text)
        end = min(hits) if hits else max(self.sent, len(text) - self.holdback)
        delta = text[self.sent:end]
        self.sent = end
        return delta, bool(hits)

    def flush(self) -> str:
        delta = self.detok.text[self.sent:]
        self.sent = len(self.detok.text)
        return delta


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.runner = ModelRunner(config, loaded)
        self.tokenizer = self.runner.tokenizer
        self.blocks = BlockManager(self.runner.kv.num_blocks, config.scheduler.block_size)
        self.scheduler = Scheduler(config.scheduler, self.blocks, self.runner.depth)
        self.last_shape: StepShape | None = None  # of the last step (its timing's meaning)
        # the requests whose prompt the last step began computing, each with its copy's
        # admission number (a chunked prompt: at its first chunk; a pipeline: the
        # micro-batches the step launched)
        self.last_began: list[tuple[str, int]] = []
        # the last step ran nothing: the requests waiting do not fit the pool (a prefill
        # instance's KV parked for pulls, or retained after them), and another step will not
        # either until blocks are freed or requests come or go
        self.stalled = False
        # the step under way computes prompt tokens (a prompt, a recompute after preemption,
        # a failover's replay), so it may be long by rights; read from other threads
        self.prompts_under_way = False
        self._under_way: deque[Launched] = deque()  # a pipeline's micro-batches, oldest first
        self._text: dict[str, TextState] = {}
        self._arrivals = itertools.count()
        # parked requests the other ranks serve the KV of, and their blocks (None: they
        # serve none; `serve_kv`)
        self._parked_on_ranks: dict[str, list[int]] | None = None
        self.guides = None if self.tokenizer is None else \
            Guides(self.tokenizer, self.model_config.vocab_size)

    @property
    def model_config(self) -> ModelConfig:
        return self.runner.model_config

    @property
    def eos_ids(self) -> frozenset[int]:
        """The ids that end a generation (none for a model without a tokenizer)."""
        return frozenset() if self.tokenizer is None else self.tokenizer.eos_ids

    def check_fits(self, num_prompt: int, max_tokens: int) -> None:
        """Raise RequestRejected if a request of this size can never run here."""
        if num_prompt == 0:
            raise RequestRejected("the prompt is empty")
        limit = self.model_config.max_context
        if num_prompt + max_tokens > limit:
            raise RequestRejected(
                f"prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) exceeds the "
                f"model's context of {limit} tokens")
        needed = blocks_for(num_prompt + max_tokens, self.blocks.block_size)
        if needed > self.blocks.num_blocks:
            raise RequestRejected(
                f"request needs {needed} KV blocks but the pool holds {self.blocks.num_blocks}")

    def make_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     output_ids: list[int] | None = None, tag: int = 0) -> Request:
        self.check_fits(len(prompt_ids), params.max_tokens)
        return Request(request_id, list(prompt_ids), params, eos_ids=self.eos_ids,
                       arrival=next(self._arrivals), output_ids=list(output_ids or []),
                       tag=tag)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    output_ids: list[int] | None = None, tag: int = 0) -> Request:
        """Queue a prompt. `output_ids`: tokens already sampled (and streamed) elsewhere, for
        a request resumed after a failure: they are computed with the prompt, the next token
        is sampled at its own output index, and only new text is emitted. `tag`: what its
        outputs carry (a worker's attempt), whatever copy of the id comes after it."""
        request = self.make_request(request_id, prompt_ids, params, output_ids, tag)
        self._replace(request)
        self.scheduler.add(request)
        return request

    def step(self) -> list[RequestOutput]:
        """Schedule, execute, update. Returns what changed for each request this step. If
        running the step fails, only its requests fail: each is aborted and gets an output
        with `error`; a failure in scheduling still raises. A pipeline of several stages
        runs its steps as micro-batches (`_pipelined_step`). Where the other ranks serve KV,
        they hear of the requests parked and unparked since the last step first (before
        this step may write blocks freed since) and last (those it parks, before anyone is
        told of them)."""
        self._sync_parked()
        self.stalled = False
        try:
            outputs = self._pipelined_step() if self.runner.depth > 1 else self._step()
        finally:
            self.prompts_under_way = False
        self._sync_parked()
        return outputs

    def _step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        self.last_shape = out.shape() if out is not None else None
        self.last_began = _began(out)
        self.stalled = out is None
        if out is None:
            return []
        self.prompts_under_way = bool(out.prefills)
        try:
            return self._update(out, self.runner.execute(out))
        except RankFailed:
            raise  # the instance has lost a rank: no later step can run either
        except Exception as e:  # the model, sampling or update: any of it fails only this step
            self.last_shape = None  # a failed step's time says nothing of the model
            return self._fail(out, e)

    def _pipelined_step(self) -> list[RequestOutput]:
        """Launch steps until one a stage is under way (or none more can be scheduled: a
        request under way waits for its update), then finish the oldest: rank 0 runs its
        stage of the next micro-batch while the later stages run the earlier ones. A step's
        time then spans parts of several micro-batches, so it has no `last_shape`."""
        self.last_shape, self.last_began = None, []
        while len(self._under_way) < self.runner.depth:
            out = self.scheduler.schedule()
            if out is None:
                break
            self.last_began += _began(out)
            try:
                self._under_way.append(self.runner.launch(out))
            except RankFailed:
                raise
            except Exception as e:  # preparing its inputs: nothing of it reached the ranks
                return self._fail(out, e)
        self.stalled = not self._under_way
        if not self._under_way:
            return []
        self.prompts_under_way = any(step.out.prefills for step in self._under_way)
        launched = self._under_way.popleft()
        try:
            return self._update(launched.out, self.runner.finish(launched))
        except RankFailed:
            raise
        except Exception as e:  # sampling or update: the ranks are done with this step
            return self._fail(launched.out, e)

    def _update(self, out: SchedulerOutput, sampled: Sampled) -> list[RequestOutput]:
        """Advance a step's requests; outputs of those that sampled and were not aborted
        while the step was under way."""
        live = [c.request for c in out.chunks if c.request.status is RequestStatus.RUNNING]
        self.scheduler.update(out, sampled)
        return [self._output(r) for r in live if r.request_id in sampled]

    def _fail(self, out: SchedulerOutput, e: Exception) -> list[RequestOutput]:
        """Abort the step's requests, wherever the failure left them (mid-prefill, decoding,
        already finished or parked by a partial update), freeing their blocks."""
        log.exception("a step of %d requests failed", len(out.chunks))
        error = f"the engine step failed: {type(e).__name__}: {e}"
        # not those aborted while it was under way (an older copy of an id taken in again
        # since among them): they were answered then
        failed = [c.request for c in out.chunks
                  if c.request.status is not RequestStatus.FINISHED_ABORTED]
        for request in failed:
            self.abort(request.request_id)
        return [RequestOutput(r.request_id, [], "", error=error, index=len(r.output_ids),
                              arrival=r.arrival, tag=r.tag) for r in failed]

    def close(self) -> None:
        """Stop the instance's other ranks (tp > 1); the engine takes no step after."""
        self.runner.close()

    def has_work(self) -> bool:
        """Requests to run, or steps under way to finish (their requests may all have been
        aborted since)."""
        return self.scheduler.has_work or bool(self._under_way)

    def abort(self, request_id: str, copy: Request | None = None) -> bool:
        """Drop the request; given `copy`, only if that is the engine's request of the id
        (not a newer attempt that replaced it). False if there was none to drop."""
        if copy is not None and self.scheduler.get(request_id) is not copy:
            return False
        self._text.pop(request_id, None)
        return self.scheduler.abort(request_id) is not None

    # -- disaggregation: a request's KV blocks leave one engine and enter another -------

    def export_kv(self, request_id: str, skip: int = 0) -> torch.Tensor:
        """A parked request's KV, every rank's, as one buffer, but its first `skip` blocks
        (in one process: a service serves each rank's part from that rank, `serve_kv`)."""
        request = self.scheduler.parked[request_id]
        assert 0 <= skip < len(request.block_table), (skip, len(request.block_table))
        return self.runner.export_kv(request.block_table[skip:])

    def export_part(self, request_id: str, part: KvSpan | None,
                    alloc: Alloc | None = None, skip: int = 0) -> torch.Tensor | None:
        """`part` (None: all) of the KV rank 0 holds of a parked request's blocks but its
        first `skip` (in room `alloc` gives); None if it is not parked, rank 0 does not hold
        that part, or no block is left after `skip`."""
        request = self.scheduler.parked.get(request_id)
        return None if request is None else \
            self.runner.export_part(request.block_table, part, alloc, skip)

    @property
    def exports_off_thread(self) -> bool:
        """Whether `export_part` may run on another thread than the steps': on the CPU it only
        reads the parked request's blocks of rank 0's pool, which no step writes; on a GPU it
        runs on the engine's stream."""
        return self.runner.device.type == "cpu"

    def serve_kv(self, host: str, key: bytes) -> list[str]:
        """Start the other ranks' KV listeners on `host`, under rank 0's token key: their
        addresses (none for one rank). From here each step tells them which requests are
        parked on which blocks."""
        if self.runner.ranks is None:
            return []
        addresses = self.runner.ranks.serve_kv(host, key)
        self._parked_on_ranks = {}
        return addresses

    def kv_moved_on_ranks(self) -> tuple[int, int]:
        """The pulls ranks other than 0 served or made, and their bytes (any thread)."""
        return (0, 0) if self.runner.ranks is None else self.runner.ranks.kv_moved()

    def _sync_parked(self) -> None:
        """Tell the ranks which requests they may serve the KV of, in one command: those no
        longer parked (or parked on other blocks) and those newly parked."""
        told, ranks = self._parked_on_ranks, self.runner.ranks
        if told is None or ranks is None:
            return
        parked = self.scheduler.parked
        unpark = [request_id for request_id, blocks in told.items()
                  if request_id not in parked or parked[request_id].block_table != blocks]
        for request_id in unpark:
            del told[request_id]
        park = {request_id: list(request.block_table) for request_id, request in parked.items()
                if request_id not in told}
        if unpark or park:
            ranks.command(Command.PARKED, text_payload(json.dumps({"unpark": unpark,
                                                                   "park": park})))
            told.update(park)

    def kv_buffer(self, num_blocks: int, alloc: Alloc | None = None) -> torch.Tensor:
        """Room for `num_blocks` blocks of the KV rank 0 holds (all of it on one rank), to
        receive KV into (`alloc`'s, on one rank): each other rank pulls its own
        (`pull_on_ranks`)."""
        if self.runner.ranks is None:
            return self.runner.kv_buffer(num_blocks, alloc)
        return self.runner.kv.empty_blocks(num_blocks, alloc)

    def pull_on_ranks(self, pulls: list[KvPull], timeout_s: float
                      ) -> list[concurrent.futures.Future[bool]] | None:
        """Have each rank but 0 pull its part of each request's KV into the pull's blocks,
        within `timeout_s`: a future a pull, True once every part is in place (None with one
        rank). The blocks stay allocated until it resolves: no rank writes them after."""
        if self.runner.ranks is None:
            return None
        return self.runner.ranks.pull_kv(pulls, timeout_s)

    def import_part(self, blocks: list[int], buffer: torch.Tensor) -> None:
        """Rank 0's part of a request's KV (`kv_buffer`'s layout) into `blocks`. On the CPU
        it may run off the steps' thread: no step reads or writes blocks not yet admitted."""
        self.runner.kv.import_blocks(blocks, buffer)

    def release(self, request_id: str) -> bool:
        self._text.pop(request_id, None)
        return self.scheduler.release(request_id) is not None

    @property
    def blocks_off_thread(self) -> bool:
        """Whether `allocate`, `free` and `kv_buffer` may run off the steps' thread, beside a
        step: with one rank on the CPU (the pool's bookkeeping is atomic, and a buffer is
        plain memory). A CUDA buffer must wait for the steps' stream, and other ranks take
        their parts' blocks in order with the steps (`pull_on_ranks`)."""
        return self.runner.ranks is None and self.runner.device.type == "cpu"

    def allocate(self, num_tokens: int) -> list[int] | None:
        """Blocks for an incoming request's K/V, or None while the pool has no room."""
        found = self.allocate_for(num_tokens)
        return None if found is None else found[0]

    def prefix_hashes(self, tokens: Sequence[int], salt: str = "") -> list[BlockHash]:
        """With prefix caching, the hashes of the blocks of `tokens` (an incoming request's
        K/V, of its `salt`) that `allocate_for` may find in the pool: all but the block of
        the last token, which always comes (a pull skips fewer blocks than the request has,
        even where the pool holds all of them); none without."""
        if not self.config.scheduler.prefix_caching:
            return []
        return chain_hashes(tokens[:len(tokens) - 1], self.blocks.block_size, salt=salt)

    def allocate_for(self, num_tokens: int, hashes: Sequence[BlockHash] = ()
                     ) -> tuple[list[int], int] | None:
        """Blocks for an incoming request's K/V of `num_tokens`, and how many of them hold it
        already: the blocks of its leading run of `hashes` (`prefix_hashes`) the pool holds,
        cached for an earlier request, so that only those after them need to come; then
        fresh ones. None while the pool has no room."""
        return self.blocks.allocate_after(hashes, blocks_for(num_tokens, self.blocks.block_size))

    def free(self, block_ids: list[int]) -> None:
        self.blocks.free(block_ids)

    def admit_imported(self, request: Request, block_ids: list[int],
                       buffer: torch.Tensor | None, computed: int | None = None,
                       held: int = 0) -> None:
        """Decode role: `request` holds its prompt and the tokens sampled so far (the first
        one, or more after a failover); the K/V of its first `computed` tokens (default: all
        but the newest) arrive in `buffer` (or were already written into `block_ids` by the
        transfer), but for its first `held` blocks, which hold it already (`allocate_for`).
        Tokens beyond `computed` are replayed in the next step, as a prefill chunk on top of
        the imported K/V."""
        self._guide(request)  # what fails here fails before the KV is copied
        if buffer is not None:
            self.runner.import_kv(block_ids[held:], buffer)
        request.block_table = block_ids
        request.num_registered = held
        request.num_computed = request.num_tokens - 1 if computed is None else computed
        if self.config.scheduler.prefix_caching:  # as the scheduler counts its admissions
            self.scheduler.prefix_queried += request.num_computed  # (the steps' thread)
            self.scheduler.prefix_hits += held * self.blocks.block_size
        request.arrival = next(self._arrivals)
        self._replace(request)
        self.scheduler.add_prefilled(request)

    # -- convenience ------------------------------------------------------------------

    def generate(self, prompts: Iterable[list[int]], params: SamplingParams) -> list[Request]:
        """Run prompts to completion together (offline batch)."""
        requests = [self.add_request(f"gen-{i}", p, params) for i, p in enumerate(prompts)]
        while self.has_work():
            self.step()
        return requests

    def _replace(self, request: Request) -> None:
        """Take `request` in, aborting an older one of the same id (a request that failed
        over comes back to an engine that may still hold its earlier attempt)."""
        self._guide(request)
        if self.scheduler.get(request.request_id) is not None:
            self.abort(request.request_id)
        self._track(request)

    def prepare(self, params: SamplingParams) -> None:
        """Compile a request's grammar, on any thread (the workers: before the engine takes
        the request in, so that no step waits on a compile); RequestRejected if its answer
        cannot be held to it here."""
        if not params.grammar:
            return
        if self.guides is None:
            raise RequestRejected("an answer held to a format needs the model's tokenizer")
        try:
            self.guides.compiled(params.grammar)
        except ValueError as e:
            raise RequestRejected(f"the answer cannot be held to its format: {e}") from e

    def _guide(self, request: Request) -> None:
        """With a grammar, give the request its guide: a copy of the grammar `prepare`
        compiled (compiled here if it was not; RequestRejected if it cannot be)."""
        if not request.params.grammar or request.guide is not None:
            return
        self.prepare(request.params)
        assert self.guides is not None
        request.guide = self.guides.guide(request.params.grammar)

    def _track(self, request: Request) -> None:
        if self.tokenizer is not None:
            # output ids streamed already, by whoever sampled them
            state = TextState(self.tokenizer, request.params.stop, request.output_ids,
                              request.prompt_ids)
            self._text[request.request_id] = state

    def _output(self, request: Request) -> RequestOutput:
        state = self._text.get(request.request_id)
        text = ""
        if state is not None:
            text, hit = state.advance(request.output_ids)
            if hit and not request.status.finished:
                self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
            elif hit and request.status is RequestStatus.FINISHED_LENGTH:
                # the last token allowed completed a stop string: its text ends there, so it
                # stopped (as OpenAI says it), not ran out of length
                request.status = RequestStatus.FINISHED_STOPPED
            elif request.status.finished and not hit:
                text += state.flush()
        if request.status.finished:
            self._text.pop(request.request_id, None)
        logprobs = request.output_logprobs[-1:] if request.params.logprobs else []
        first = len(request.output_ids) == 1  # the prompt's scores go with the first token
        # a grammar that outgrew its limits ended the answer: the request fails, saying why
        failure = None if request.guide is None else request.guide.failure
        return RequestOutput(request.request_id, request.output_ids[-1:], text,
                             request.finish_reason, request.status is RequestStatus.PARKED,
                             logprobs, request.output_top[-1:],
                             request.prompt_scores if first else [], error=failure,
                             index=len(request.output_ids) - 1, arrival=request.arrival,
                             tag=request.tag, refused=failure is not None,
                             cached_tokens=request.cached_tokens if first else 0)
