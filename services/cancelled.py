"""The requests a gateway cancelled lately, which a worker must not start; and the attempts
that ended on a worker, which it must not start again (a copy of a message sent again where
its acknowledgement was lost: `shared.bus.deliver`).

A cancel can overtake its request: NATS hands each subscription's messages to a task of its
own, so a worker may read the gateway's cancel before the prompt (or the decode instance's
announcement) sent earlier, and a prompt being admitted waits for the engine's step in
progress while a cancel is read. Without a memory of it, such a request ran to its end with
nobody listening, its KV held all the while."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

EVERY = None  # a cancel of every attempt: the client went away


class Cancelled:
    """Request ids cancelled in the last `keep_s` seconds (at most `most` of them; the oldest
    go first), each for every attempt or for the attempts up to one (a gateway moved the
    request away from this instance: those attempts are stale here, a later one may come
    back). A request id names one client request for good."""

    def __init__(self, keep_s: float = 300.0, most: int = 65536,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.keep_s, self.most, self.clock = keep_s, most, clock
        self._at: OrderedDict[str, tuple[float, int | None]] = OrderedDict()

    def add(self, request_id: str, up_to: int | None = EVERY) -> None:
        """Cancel `request_id`'s attempts up to `up_to` (EVERY: all of them)."""
        _, before = self._at.pop(request_id, (0.0, -1))
        covered = EVERY if before is EVERY or up_to is EVERY else max(before, up_to)
        self._at[request_id] = (self.clock(), covered)
        self._expire()

    def covers(self, request_id: str, attempt: int) -> bool:
        """Whether `attempt` of `request_id` was cancelled."""
        self._expire()
        if request_id not in self._at:
            return False
        up_to = self._at[request_id][1]
        return up_to is EVERY or attempt <= up_to

    def __contains__(self, request_id: object) -> bool:
        """Whether every attempt of `request_id` was cancelled."""
        self._expire()
        return request_id in self._at and self._at[request_id][1] is EVERY  # type: ignore[index]

    def __len__(self) -> int:
        self._expire()
        return len(self._at)

    def _expire(self) -> None:
        oldest = self.clock() - self.keep_s
        while self._at and (len(self._at) > self.most or next(iter(self._at.values()))[0] < oldest):
            self._at.popitem(last=False)
