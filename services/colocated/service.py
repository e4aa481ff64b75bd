"""A colocated worker: the engine's colocated role (vLLM-style, or chunked prefill) behind the
same gateway and messages as the disaggregated instances, so one client and one benchmark
compare both designs."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg

from services.runtime import Worker
from shared import subjects
from shared.bus import acknowledge, parse
from shared.engine.config import Role
from shared.engine.engine import RequestOutput
from shared.messages import Cancel, PrefillRequest
from shared.telemetry import context_from, record

PENDING = -1  # the copy of an attempt the engine has not yet taken in: no output is its


class ColocatedService(Worker):
    """Traces each request's stages under the names a disaggregated pair's spans have:
    "prefill queue" until the step that began computing its prompt, "prefill run" until its
    first token (a chunked prompt's chunks and the decodes beside them in it), "decode run"
    until its end; no KV moves, so there is no transfer or decode queue."""

    role = "colocated"
    engine_role = Role.COLOCATED
    known: dict[str, int]  # request -> the newest attempt that came here, until it ends
    # request -> when it came, its trace headers and prompt tokens, until its first token
    arrived: dict[str, tuple[float, dict[str, str], int]]
    # request -> the start of the step that began its prompt, by engine copy (an older
    # copy's may come in while a newer attempt waits), until its first token
    began: dict[str, dict[int, float]]
    copies: dict[str, int]  # request -> the engine copy of the attempt traced
    decoding: dict[str, tuple[float, dict[str, str]]]  # request -> its first token's time

    def subscriptions(self) -> dict[str, Callable[[Msg], Awaitable[None]]]:
        self.known, self.arrived, self.began, self.copies, self.decoding = {}, {}, {}, {}, {}
        self.host.on_began = self._began
        return {subjects.prefill(self.id): self._on_request, subjects.CANCEL_ALL: self._on_cancel}

    async def _on_request(self, msg: Msg) -> None:
        req = parse(msg, PrefillRequest)
        await acknowledge(msg)
        if req.attempt <= self.known.get(req.request_id, -1):
            return  # a newer attempt came first, or this one again (its answer was lost)
        self.known[req.request_id] = req.attempt  # before the engine takes it in
        self.gateways[req.request_id] = req.gateway
        self._untrace(req.request_id)  # an older attempt's, replaced
        self.arrived[req.request_id] = (time.time(), dict(msg.headers or {}),
                                        len(req.prompt_ids))
        self.copies[req.request_id] = PENDING  # until the engine has taken it in
        self.take_in(self._admit(req))

    async def _admit(self, req: PrefillRequest) -> None:
        request = await self.admit(req)
        if self.known.get(req.request_id) != req.attempt:
            return  # a newer attempt came meanwhile: it is the one traced
        if request is None:
            del self.known[req.request_id]
            self._untrace(req.request_id)
        else:
            self.copies[req.request_id] = request.arrival

    def _began(self, began: list[tuple[str, int]], started: float) -> None:
        for request_id, copy in began:
            if request_id in self.arrived:  # else cancelled, failed or past its first token
                self.began.setdefault(request_id, {}).setdefault(copy, started)

    async def on_outputs(self, outputs: list[RequestOutput]) -> None:
        now = time.time()
        for out in outputs:
            await self.stream(out)
            self._trace(out, now)
            if out.finished and self.known.get(out.request_id) == out.tag:
                del self.known[out.request_id]  # (an older copy's end: the newer one runs on)

    def _trace(self, out: RequestOutput, now: float) -> None:
        request_id = out.request_id
        if out.arrival != self.copies.get(request_id, out.arrival):
            return  # an older copy's, which a newer attempt replaces (or will)
        if out.error is not None:  # failed: its stages say nothing
            self._untrace(request_id)
            return
        if request_id in self.arrived and (out.new_token_ids or out.finished):
            arrived, headers, prompt_tokens = self.arrived.pop(request_id)
            started = self.began.pop(request_id, {}).get(out.arrival, self.host.step_started)
            began = min(max(arrived, started), now)
            parent = context_from(headers)
            record(self.tracer, "prefill queue", parent, arrived, began, instance=self.id)
            record(self.tracer, "prefill run", parent, began, now, instance=self.id,
                   prompt_tokens=prompt_tokens)
            self.decoding[request_id] = (now, headers)
        if out.finished and request_id in self.decoding:
            first, headers = self.decoding.pop(request_id)
            record(self.tracer, "decode run", context_from(headers), first, now,
                   instance=self.id, finish_reason=out.finish_reason or "error")
        if out.finished:
            self._untrace(request_id)

    def _untrace(self, request_id: str) -> None:
        for traced in (self.arrived, self.began, self.copies, self.decoding):
            traced.pop(request_id, None)

    def held(self) -> dict[str, int]:
        return dict(self.known)

    def cancel(self, cancel: Cancel) -> None:
        """Abort the request if the cancel covers the newest attempt that came here: a
        cancel naming an older attempt (the gateway moved it away, then back here) leaves
        the newer one be; the engine replaces the older copy with it."""
        request_id = self.cancel_for_me(cancel)
        if request_id is None or request_id not in self.known or \
                not self.cancelled.covers(request_id, self.known[request_id]):
            return
        del self.known[request_id]
        self.attempts.pop(request_id, None)
        self._untrace(request_id)
        self.abort(request_id)
