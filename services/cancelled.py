"""The requests a gateway cancelled lately, which a worker must not start.

A cancel can overtake its request: NATS hands each subscription's messages to a task of its
own, so a worker may read the gateway's cancel before the prompt (or the decode instance's
announcement) sent earlier, and a prompt being admitted waits for the engine's step in
progress while a cancel is read. Without a memory of it, such a request ran to its end with
nobody listening, its KV held all the while."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class Cancelled:
    """Request ids cancelled in the last `keep_s` seconds (at most `most` of them; the oldest
    go first). A request id names one client request for good, so once cancelled, any of its
    messages still on the way is stale."""

    def __init__(self, keep_s: float = 300.0, most: int = 65536,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.keep_s, self.most, self.clock = keep_s, most, clock
        self._at: OrderedDict[str, float] = OrderedDict()

    def add(self, request_id: str) -> None:
        self._at.pop(request_id, None)
        self._at[request_id] = self.clock()
        self._expire()

    def __contains__(self, request_id: object) -> bool:
        self._expire()
        return request_id in self._at

    def __len__(self) -> int:
        self._expire()
        return len(self._at)

    def _expire(self) -> None:
        oldest = self.clock() - self.keep_s
        while self._at and (len(self._at) > self.most or next(iter(self._at.values())) < oldest):
            self._at.popitem(last=False)
