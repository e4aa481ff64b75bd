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
    known: set[str]

    def subscriptions(self) -> dict[str, Callable[[Msg], Awaitable[None]]]:
        self.known = set()
        return {subjects.prefill(self.id): self._on_request, subjects.CANCEL_ALL: self._on_cancel}

    async def _on_request(self, msg: Msg) -> None:
        req = parse(msg, PrefillRequest)
        self.known.add(req.request_id)  # before the engine takes it in: a cancel aborts it
        self.take_in(self._admit(req))

    async def _admit(self, req: PrefillRequest) -> None:
        if await self.admit(req) is None:
            self.known.discard(req.request_id)

    async def on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            await self.stream(out)
            if out.finished:
                self.known.discard(out.request_id)

    async def _on_cancel(self, msg: Msg) -> None:
        request_id = self.cancel_for_me(msg)
        if request_id is not None and request_id in self.known:
            self.known.discard(request_id)
            self.attempts.pop(request_id, None)
            await self.host.call(self.engine.abort, request_id)
