"""The engine host: every engine call of a worker on one dedicated thread, in order, and the
step loop that runs while the engine has work; what it counts of its steps (their times,
the thread's CPU and waiting time, the last steps' shapes for calibration) goes into the
worker's heartbeats."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from shared.engine.engine import Engine, RequestOutput
from shared.engine.scheduler import StepShape

T = TypeVar("T")


def thread_clock() -> tuple[float, float]:
    """The calling thread's seconds on a CPU and seconds runnable but waiting for one, so far
    (the second from the kernel's /proc/thread-self/schedstat; 0 where it does not say)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            waited = int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        waited = 0.0
    return time.thread_time(), waited


class EngineHost:
    """Runs every engine call on one dedicated thread, in order: the event loop stays free
    for NATS, UCX and heartbeats while a step computes, and the engine needs no locks."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._wake = asyncio.Event()
        self.step_started = 0.0  # wall-clock start of the step whose outputs are delivered
        # told after each step of the requests whose prompt it began computing (and which
        # copy), with the step's wall-clock start (a colocated worker's "prefill queue" span)
        self.on_began: Callable[[list[tuple[str, int]], float], None] | None = None
        self.busy_since = 0.0  # wall-clock start of the step not yet counted (0: none)
        self.calling_since = 0.0  # wall-clock start of the engine thread's call (0: none)
        # where the loop's time goes: engine steps, handling their outputs, requests per step
        self.steps = 0
        self.step_s = 0.0
        # of which the engine thread ran on a CPU, and waited runnable for one (a step slower
        # than alone with no more CPU is the host's other work taking the core)
        self.step_cpu_s = 0.0
        self.step_queued_s = 0.0
        self.outputs_s = 0.0
        self.batched = 0  # requests that got a token, summed over steps
        self.stalled_steps = 0  # tries that ran nothing (what waits does not fit the pool)
        # the last priced steps, for calibration: (step count, shape, seconds, ended)
        self.samples: deque[tuple[int, StepShape, float, float]] = deque(maxlen=64)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the engine thread, after the step under way. Whatever a call from
        the service changes (a request taken in or aborted, blocks freed or imported) may
        give the next step something to run, so it wakes the loop."""
        return await self.submit(fn, *args)

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """`fn(*args)` queued on the engine thread now, in order with every call before and
        after it, its result awaited later (or not): a subscription's callback queues its
        engine call without waiting for the step under way. Wakes the loop when done."""
        future = self._on_thread(fn, *args)
        future.add_done_callback(lambda _: self._wake.set())
        return future

    def _on_thread(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """`fn(*args)` queued on the engine thread (no wake: the step loop's own)."""
        return asyncio.get_running_loop().run_in_executor(self._thread, self._timed, fn, *args)

    def _timed(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the engine thread, saying since when it runs (`calling_since`)."""
        self.calling_since = time.time()
        try:
            return fn(*args)
        finally:
            self.calling_since = 0.0

    def stuck_since(self) -> float:
        """Since when the engine has been at one thing (0: nothing): the step whose outputs
        are not handled yet, or whatever the engine thread runs (a step, an export or import
        of KV, a request taken in)."""
        started = [t for t in (self.busy_since, self.calling_since) if t > 0]
        return min(started, default=0.0)

    def wake(self) -> None:
        self._wake.set()

    async def run(self, on_outputs: Callable[[list[RequestOutput]], Awaitable[None]],
                  on_stalled: Callable[[], Awaitable[bool]] | None = None,
                  stalled_poll_s: float = 0.05) -> None:
        """Step while the engine has work. After a step that ran nothing (the waiting
        requests do not fit the pool) `on_stalled` may make room (True: it freed something);
        otherwise the next try waits for a wake (any engine call from the service, or
        `wake()`) or `stalled_poll_s`, whichever comes first. Tried again at once, it spun
        the engine thread at ~1 ms a try, a core taken from the host's other workers for as
        long as the pool stayed full (measured: 11,750 empty steps in 13 s on a prefill
        instance whose pool held the retained KV of 8 requests/s)."""
        stalled = False  # the last step ran nothing
        while True:
            if not self.engine.has_work():
                stalled = False
                self._wake.clear()  # before the check, so a wake during it is not lost
                if not self.engine.has_work():
                    await self._wake.wait()
                continue
            if stalled and not (on_stalled is not None and await on_stalled()):
                with contextlib.suppress(TimeoutError):  # a wake since the step: at once
                    async with asyncio.timeout(stalled_poll_s):
                        await self._wake.wait()
            self._wake.clear()
            started = self.busy_since = time.time()
            outputs, cpu_s, queued_s = await self._on_thread(self._step)  # not a wake
            handled = time.time()
            stalled = self.engine.stalled
            if stalled:  # not a step the step counters should average in
                self.stalled_steps += 1
                self.busy_since = 0.0
                continue
            self.step_started = started
            if self.on_began is not None and self.engine.last_began:
                self.on_began(self.engine.last_began, started)
            if outputs:
                await on_outputs(outputs)
            self.steps += 1
            self.batched += len(outputs)
            # the step's seconds before their parts: a heartbeat read between these lines
            # never sees more CPU time than step time
            self.step_s += handled - started
            self.step_cpu_s += cpu_s
            self.step_queued_s += queued_s
            if self.engine.last_shape is not None:
                self.samples.append((self.steps, self.engine.last_shape, handled - started,
                                     handled))
            self.busy_since = 0.0  # counted (and priced): a heartbeat now has all of it
            self.outputs_s += time.time() - handled

    def _step(self) -> tuple[list[RequestOutput], float, float]:
        """A step, with the engine thread's seconds on a CPU and waiting for one in it."""
        cpu, queued = thread_clock()
        outputs = self.engine.step()
        cpu_after, queued_after = thread_clock()
        return outputs, cpu_after - cpu, queued_after - queued
