"""A worker's heartbeats: its load on NATS (the gateways' view) and to Redis (the planner's
and profiler's registry), from a thread of its own, with the alive file its supervisor
watches (services/liveness.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable

import nats.errors
from redis.exceptions import RedisError

from services.liveness import HUNG, forget_alive, hang_timeout, leave_when_stuck, show_alive
from services.process import WorkerSettings
from shared import subjects
from shared.bus import connect, publish
from shared.state import InstanceInfo, Registry, redis_client

log = logging.getLogger(__name__)


class Heartbeats:
    """The instance's heartbeats, sent from a thread of its own (its own event loop, NATS
    connection and Redis client): on NATS for the gateways' view, to Redis for the planner's
    and profiler's registry. A worker whose event loop is held up for a while (ucxx opens an
    endpoint synchronously, for up to seconds) is not taken for dead; one whose loop is wedged
    still shows, since its engine steps stop advancing. A Redis that fails is logged and
    tried again next beat, never fatal."""

    def __init__(self, settings: WorkerSettings, info: Callable[[], InstanceInfo],
                 turning: Callable[[], bool] | None = None,
                 stuck_since: Callable[[], float] | None = None,
                 exit_code: Callable[[], int] = lambda: HUNG,
                 ticks: Callable[[], int] | None = None) -> None:
        """`turning`: whether to touch the alive file (a supervisor watches it);
        `stuck_since`: since when the engine is at one thing, and `ticks`: the main loop's
        count of turns, for a worker no supervisor watches to leave with `exit_code()` past
        its step timeout or, its loop held, past DS_HANG_TIMEOUT_S (`leave_when_stuck`)."""
        self.settings, self.info, self.turning = settings, info, turning
        self.stuck_since, self.exit_code, self.ticks = stuck_since, exit_code, ticks
        self._thread = threading.Thread(target=lambda: asyncio.run(self._forever()),
                                        name="heartbeats", daemon=True)
        self._stop = threading.Event()
        self._failing = False

    def start(self) -> None:
        self._thread.start()

    def halt(self) -> None:
        """Beat no more and judge nothing more (the watchdog): at once, from any thread."""
        self._stop.set()

    def stop(self) -> None:
        self.halt()
        self._thread.join(timeout=10)
        forget_alive(self.settings.alive_file)

    async def _forever(self) -> None:
        nc = await connect(self.settings.nats_url, f"{self.settings.instance_id}-heartbeats")
        redis = redis_client(self.settings.redis_url)
        registry = Registry(redis, self.settings.heartbeat_ttl_s)
        writing: asyncio.Task[None] | None = None
        alive = asyncio.create_task(
            show_alive(self.settings.alive_file, turning=self.turning)
            if self.settings.alive_file or self.stuck_since is None
            else leave_when_stuck(self.stuck_since, self.settings.step_timeout_s,
                                  self.exit_code, self.settings.instance_id, self.ticks,
                                  hang_timeout(os.environ), self._stop.is_set))
        while not self._stop.is_set():
            beat = self.info().model_copy(update={"heartbeat_at": time.time()})
            with contextlib.suppress(nats.errors.Error, OSError):  # NATS down: next beat
                await publish(nc, subjects.HEARTBEATS, beat)
            if writing is None or writing.done():  # a Redis that hangs delays no NATS beat
                writing = asyncio.create_task(self._register(registry, beat))
            await asyncio.sleep(self.settings.heartbeat_s)
        if writing is not None:
            writing.cancel()
        alive.cancel()
        await asyncio.gather(alive, return_exceptions=True)
        await nc.close()
        await redis.aclose()

    async def _register(self, registry: Registry, beat: InstanceInfo) -> None:
        try:
            await registry.heartbeat(beat)
            if self._failing:
                log.info("%s: Redis heartbeats work again", beat.instance_id)
            self._failing = False
        except (RedisError, OSError) as e:
            if not self._failing:
                log.warning("%s: Redis heartbeat failed (%s); retrying every %.1fs",
                            beat.instance_id, e, self.settings.heartbeat_s)
            self._failing = True
