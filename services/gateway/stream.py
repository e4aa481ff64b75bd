"""One request's token stream, relayed from the workers to the gateway. It ends when a worker
says the request ended (a finish reason or an error), or when the gateway gives up on it:
the instance serving it stopped heartbeating, or neither a token nor an engine step of that
instance came for `stall_s` (a request queued behind others on a live, busy instance is never
given up on)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from services.gateway.view import InstanceView
from shared import subjects
from shared.bus import parse
from shared.messages import TokenChunk


class GaveUp(Exception):
    """The gateway stopped waiting for the request; the workers must be told to drop it."""


class Relay:
    def __init__(self, nc: Client, view: InstanceView, request_id: str, worker: str,
                 decode: str, stall_s: float, poll_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.nc, self.view, self.request_id = nc, view, request_id
        self.worker, self.decode = worker, decode
        self.stall_s, self.poll_s, self.clock = stall_s, poll_s, clock
        self.serving = worker  # until the first token, then the decode instance
        self.prefilled = not decode  # the prefill instance is done with the request
        self.finished = False  # a worker said the request ended
        self._queue: asyncio.Queue[TokenChunk] = asyncio.Queue()
        self._sub: Any = None
        self._progress_at = clock()
        self._steps = -1

    async def open(self) -> None:
        """Listen before the request is sent, so no chunk can be missed."""
        self._sub = await self.nc.subscribe(subjects.tokens(self.request_id), cb=self._on_chunk)

    async def close(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    async def _on_chunk(self, msg: Msg) -> None:
        self._queue.put_nowait(parse(msg, TokenChunk))

    async def next(self) -> TokenChunk:
        """The next chunk from the workers; GaveUp if the request cannot finish."""
        while True:
            try:
                chunk = await asyncio.wait_for(self._queue.get(), timeout=self.poll_s)
            except TimeoutError:
                self._check(self.clock())
                continue
            self._progress_at = self.clock()
            if not self.prefilled and (chunk.source == self.worker or chunk.error):
                self.prefilled, self.serving = True, self.decode
            self.finished = chunk.finish_reason is not None or chunk.error is not None
            return chunk

    def _check(self, now: float) -> None:
        info = self.view.get(self.serving, now)
        if info is None:
            raise GaveUp(f"instance {self.serving} stopped")
        if info.steps != self._steps:  # the instance is working through its queue
            self._steps, self._progress_at = info.steps, now
        if now - self._progress_at > self.stall_s:
            raise GaveUp(f"no progress on instance {self.serving} for {self.stall_s:.0f}s")
