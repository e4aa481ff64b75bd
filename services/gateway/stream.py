"""One request's token stream, relayed from the workers to the gateway, across moves. It
ends when a worker says the request ended (a finish reason or an error). It is `Lost`, for
the gateway to move it, when the request cannot go on where it is but is intact: the
instance serving it stopped heartbeating; neither a token nor an engine step of that
instance came for `stall_s` (a request queued behind others on a live, busy instance is
never lost); the decode instance serving it has been at one step or call past `stuck_s`
while another decode instance is not (a decode step is short: a wedged engine heartbeats
on, and its streams would wait out `stall_s`; a step that computes prompt tokens, a
prefill's or a decode instance's recompute after preemption, may be long by rights); a
chunk went missing (its `seq` skips ahead); a decode instance could not pull its KV; the
decode instance never started it and the prefill instance holding its KV died;
or the decode instance running it, with none preempted, made `silent_steps` steps without a
chunk for it (a running request gets a token every step: its chunks, the last one included,
went missing); or the instance serving it has said for `absent_s` that it does not hold this
attempt (its heartbeats list what each instance holds): it ended there, or never arrived,
with every chunk lost (a NATS outage as a short request ran: an instance busy with others
never stalls, and a request never heard from has no gap to see).

Each move is a new attempt: chunks of older attempts (an instance moved away from that
still speaks) are dropped, as are chunks repeating tokens already relayed."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from services.gateway.view import InstanceView, stuck, stuck_for, unstuck
from shared import subjects
from shared.bus import parse
from shared.messages import TokenChunk
from shared.state import InstanceInfo


class GaveUp(Exception):
    """The gateway stopped trying the request; the workers must be told to drop it."""


class Lost(Exception):
    """The request cannot go on where it is, but can elsewhere: `cause` names why (a
    bounded label: decode_died, prefill_died, worker_died, stalled, stuck, gap,
    kv_transfer)."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(detail)
        self.cause = cause


class Relay:
    def __init__(self, nc: Client, view: InstanceView, request_id: str, worker: str,
                 decode: str, stall_s: float, poll_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic, silent_steps: int = 64,
                 absent_s: float = 8.0, stuck_s: float | None = None) -> None:
        self.nc, self.view, self.request_id = nc, view, request_id
        self.stall_s, self.poll_s, self.clock = stall_s, poll_s, clock
        self.stuck_s = stuck_s  # None: a stuck decode instance's streams wait out stall_s
        self.silent_steps, self.absent_s = silent_steps, absent_s
        self.output_ids: list[int] = []  # every token relayed so far, in order
        self._attempts = itertools.count()
        self.attempt = 0
        self.moves = 0
        self.finished = False  # a worker said the request ended
        self.failed = False  # ... with an error (it may still run there: cancel it anyway)
        self._scored = 0  # the prompt positions whose scores this attempt relayed
        self._queue: asyncio.Queue[TokenChunk] = asyncio.Queue()
        self._sub: Any = None
        self._undelivered = ""  # why the current attempt never reached its worker
        self.retarget(worker, decode, prefilled=not decode)

    def new_attempt(self) -> int:
        """A number no attempt of this request has had: each names one leg, so a late
        answer about one leg can never be taken for another's."""
        return next(self._attempts)

    def retarget(self, worker: str, decode: str, prefilled: bool,
                 attempt: int | None = None) -> None:
        """Follow the request's next attempt (`attempt`, or a new one): prefilled on
        `worker` (a colocated worker when `decode` is empty), then decoded on `decode`;
        `prefilled` when its KV is already prefilled and only the decode instance will
        speak."""
        self.attempt = self.new_attempt() if attempt is None else attempt
        self.worker, self.decode = worker, decode
        self.prefilled = prefilled  # the prefill instance is done with this attempt
        self.serving = decode if prefilled and decode else worker
        self._progress_at = self.clock()
        self._scored = 0  # a new attempt scores the prompt from its start
        self._steps = -1
        self._heard_decode = False  # a chunk of this attempt came from the decode instance
        self._steps_at_chunk: int | None = None  # the decode instance's steps at the last one
        self._worker_gone_at: float | None = None
        self._absent_since: float | None = None  # the serving instance says it lacks this

    async def open(self) -> None:
        """Listen before the request is sent, so no chunk can be missed."""
        self._sub = await self.nc.subscribe(subjects.tokens(self.request_id), cb=self._on_chunk)

    async def close(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    async def _on_chunk(self, msg: Msg) -> None:
        self._queue.put_nowait(parse(msg, TokenChunk))

    def undelivered(self, detail: str) -> None:
        """The current attempt never reached its worker: the next `next` is Lost."""
        self._undelivered = detail

    async def next(self) -> TokenChunk:
        """The next chunk of the current attempt; Lost if the request cannot go on here."""
        if self._undelivered:
            detail, self._undelivered = self._undelivered, ""
            raise Lost("undelivered", detail)
        while True:
            try:
                async with asyncio.timeout(self.poll_s):
                    chunk = await self._queue.get()
            except TimeoutError:
                self._check(self.clock())
                continue
            if self.accept(chunk):
                return chunk

    def accept(self, chunk: TokenChunk) -> bool:
        """Whether `chunk` goes to the client (pure but for the clock); raises Lost for a
        gap or a failed pull."""
        if chunk.attempt != self.attempt:
            return False  # from an instance the request has moved away from
        if chunk.retry:
            raise Lost("kv_transfer", chunk.error or "the KV transfer failed")
        if chunk.prompt_logprobs:  # a part of the prompt's scores, in order
            if chunk.prompt_from != self._scored:
                raise Lost("gap", f"the scores of prompt tokens {self._scored}-"
                                  f"{chunk.prompt_from - 1} of {self.request_id} never arrived")
            self._scored += len(chunk.prompt_logprobs)
            if not (chunk.token_ids or chunk.finish_reason or chunk.error):
                self._progress_at = self.clock()  # the first token comes next (nothing is
                return True  # known prefilled before it)
        if chunk.token_ids and chunk.seq != len(self.output_ids):
            if chunk.seq < len(self.output_ids):
                return False  # tokens relayed already
            raise Lost("gap", f"tokens {len(self.output_ids)}-{chunk.seq - 1} of "
                              f"{self.request_id} never arrived")
        self.output_ids += chunk.token_ids
        self._progress_at = self.clock()
        self._absent_since = None
        if self.decode and chunk.source == self.decode:
            self._heard_decode = True
            self._steps_at_chunk = None  # taken at the next check
        if not self.prefilled and (chunk.source == self.worker or chunk.error):
            self.prefilled, self.serving = True, self.decode or self.worker
            self._absent_since = None  # the decode instance hears of it from here on
        self.finished = chunk.finish_reason is not None or chunk.error is not None
        self.failed = chunk.error is not None
        return True

    def _role(self) -> str:
        if not self.decode:
            return "worker"
        return "decode" if self.serving == self.decode else "prefill"

    def _check(self, now: float) -> None:
        info = self.view.get(self.serving, now)
        if info is None:
            raise Lost(f"{self._role()}_died", f"instance {self.serving} stopped")
        if self.decode and self.serving == self.decode and not self._heard_decode:
            # announced to the decode instance, whose pull needs the prefill instance alive
            if self.view.get(self.worker, now) is not None:
                self._worker_gone_at = None
            elif self._worker_gone_at is None:
                self._worker_gone_at = now
            elif now - self._worker_gone_at > 2 * self.view.ttl_s:
                raise Lost("prefill_died", f"instance {self.worker}, holding the KV, stopped")
        if self._heard_decode and self.serving == self.decode:
            if info.preempted:  # this one may be among them, waiting without tokens
                self._steps_at_chunk = None
            elif self._steps_at_chunk is None:
                self._steps_at_chunk = info.steps
            elif info.steps - self._steps_at_chunk > self.silent_steps:
                raise Lost("gap", f"{self.serving} made {self.silent_steps} steps without a "
                                  f"token of {self.request_id}")
        if info.held.get(self.request_id) == self.attempt:
            self._absent_since = None
        elif self._absent_since is None:
            self._absent_since = now
        elif now - self._absent_since > self.absent_s:
            raise Lost("gap", f"{self.serving} does not hold attempt {self.attempt} of "
                              f"{self.request_id} (its chunks were lost)")
        tried = info.steps + info.stalled_steps  # a full pool waits on the pulls: still live
        if tried != self._steps:  # the instance is working through its queue
            self._steps, self._progress_at = tried, now
        if now - self._progress_at > self.stall_s:
            raise Lost("stalled", f"no progress on instance {self.serving} for "
                                  f"{self.stall_s:.0f}s")
        if self._stuck_decode(info, now):
            raise Lost("stuck", f"the engine of {self.serving} has been at one step or call "
                                f"for {stuck_for(info):.0f}s")

    def _stuck_decode(self, info: InstanceInfo, now: float) -> bool:
        """Whether the decode instance serving the request is stuck (`info`) and another
        is not: one stuck instance of a role is all there is to move to (the gateway's
        stuck_pools), and moving there again and again would spend the request's moves."""
        if self.stuck_s is None or not self.decode or self.serving != self.decode or \
                info.stuck_on_prompts or not stuck(info, self.stuck_s):
            return False
        return any(i.instance_id != self.serving and not i.draining
                   for i in unstuck(self.view.instances("decode", now), self.stuck_s))
