"""Cancelling tasks that must end: one that loses a cancel is cancelled again."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

from services.gateway.gateway import Gateway, GatewaySettings
from shared.aio import cancel_within
from shared.state import redis_client


def test_a_task_that_loses_its_cancel_is_cancelled_again_and_one_that_ignores_all_is_left(
) -> None:
    """A task that swallows one cancel (as a Redis call does on Python 3.11, below) ends at
    the next; one that catches every cancel, or whose clean-up hangs, is left, named, rather
    than holding a stop for good."""
    async def loses_one() -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(60)
        while True:
            await asyncio.sleep(0.01)

    over = asyncio.Event()

    async def ignores_all() -> None:
        while not over.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(60)

    async def main() -> None:
        tasks = [asyncio.create_task(loses_one()), asyncio.create_task(ignores_all()),
                 asyncio.create_task(asyncio.sleep(60))]
        await asyncio.sleep(0)
        started = time.monotonic()
        try:
            left = await cancel_within(tasks, 0.5)
            assert 0.5 <= time.monotonic() - started < 5
            assert left == {tasks[1]}
            assert tasks[0].cancelled() and tasks[2].cancelled()
            assert await cancel_within([], 0.2) == set()
        finally:  # the test's own clean-up, pass or fail
            over.set()
            await cancel_within(tasks, 5.0)

    asyncio.run(main())


def test_the_gateways_redis_loop_ends_when_cancelled_at_any_moment(redis_url: str) -> None:
    """The gateway's in-flight publisher (its lease, then the other gateways' counts: a
    pipeline, SCAN and MGET), against a real Valkey, rounds back to back: cancelled at 40
    random moments, it ends each time. On Python 3.11 redis-py sends each command under
    `asyncio.wait_for`, which returns its result when the command ends just as the cancel
    lands; cancelled once, this loop ran on for good about one time in five here."""
    gateway = Gateway(GatewaySettings(redis_url=redis_url))
    gateway.redis = redis_client(redis_url)

    async def main() -> None:
        rng = random.Random(7)
        tasks: list[asyncio.Task[None]] = []
        try:
            for _ in range(40):
                tasks.append(asyncio.create_task(gateway._publish_inflight(every_s=0)))
                await asyncio.sleep(rng.uniform(0.005, 0.05))
                assert not tasks[-1].done()
                assert await cancel_within([tasks[-1]], 5.0) == set()
                assert tasks[-1].cancelled()
        finally:  # the test's own clean-up, pass or fail
            await cancel_within(tasks, 5.0)
            await gateway.redis.aclose()

    asyncio.run(main())
