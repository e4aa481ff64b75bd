"""A colocated worker: the engine's colocated role (vLLM-style, or chunked prefill) behind the
same gateway and messages as the disaggregated instances, so one client and one benchmark
compare both designs."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg

from services.runtime import Worker
from shared import subjects
from shared.bus import parse
from shared.engine.config import Role
from shared.engine.engine import RequestOutput
from shared.messages import PrefillRequest


class ColocatedService(Worker):
    role = "colocated"
    engine_role = Role.COLOCATED
    known: dict[str, int]  # request -> the newest attempt that came here, until it ends

    def subscriptions(self) -> dict[str, Callable[[Msg], Awaitable[None]]]:
        self.known = {}
        return {subjects.prefill(self.id): self._on_request, subjects.CANCEL_ALL: self._on_cancel}

    async def _on_request(self, msg: Msg) -> None:
        req = parse(msg, PrefillRequest)
        if req.attempt < self.known.get(req.request_id, -1):
            return  # a newer attempt came first: this one is stale
        self.known[req.request_id] = req.attempt  # before the engine takes it in
        self.take_in(self._admit(req))

    async def _admit(self, req: PrefillRequest) -> None:
        if await self.admit(req) is None and self.known.get(req.request_id) == req.attempt:
            del self.known[req.request_id]

    async def on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            await self.stream(out)
            if out.finished:
                self.known.pop(out.request_id, None)

    async def _on_cancel(self, msg: Msg) -> None:
        """Abort the request if the cancel covers the newest attempt that came here: a
        cancel naming an older attempt (the gateway moved it away, then back here) leaves
        the newer one be; the engine replaces the older copy with it."""
        request_id = self.cancel_for_me(msg)
        if request_id is None or request_id not in self.known or \
                not self.cancelled.covers(request_id, self.known[request_id]):
            return
        del self.known[request_id]
        self.attempts.pop(request_id, None)
        self.abort(request_id)
