"""asyncio helpers the services share.

On Python 3.11 a task can lose its cancellation: `asyncio.wait_for` returns its awaitable's
result when that finishes just as the task is cancelled, and the task goes on as if never
cancelled (CPython gh-86296, fixed in 3.12, whose `wait_for` is `asyncio.timeout`).
redis-py's asyncio client sends every command through `wait_for`: a loop of Redis calls
cancelled once went on for good about one time in five (measured with a real Valkey). So
our own code waits with `asyncio.timeout` (ruff bans `asyncio.wait_for` here), and a task
that must end is cancelled until it does (`cancel_within`)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)

RECANCEL_S = 0.05  # a task still running this long after its cancel is cancelled again
STOP_TASKS_S = 5.0  # a service's background tasks get this long to end as it stops


async def cancel_within(tasks: list[asyncio.Task[Any]], within_s: float = STOP_TASKS_S,
                        who: str = "") -> set[asyncio.Task[Any]]:
    """Cancel `tasks`, again every RECANCEL_S while they run (a cancel one swallowed lands
    at its next await), and wait up to `within_s` for them to end; the ones still running
    (one that catches every cancel, or whose clean-up hangs), logged as `who`'s and left to
    the caller. A clean-up that awaits for longer than RECANCEL_S is cancelled too: shield
    it."""
    left = set(tasks)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while left:
        for task in left:
            task.cancel()
        if (wait_s := min(RECANCEL_S, deadline - loop.time())) <= 0:
            break
        _, left = await asyncio.wait(left, timeout=wait_s)
    if left:
        log.warning("%sstopping: %s did not end within %.0f s of being cancelled; left",
                    f"{who}: " if who else "", ", ".join(sorted(
                        getattr(t.get_coro(), "__qualname__", t.get_name()) for t in left)),
                    within_s)
    return left
