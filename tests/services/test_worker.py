"""A worker whose engine loop dies leaves dispatch and exits loudly; a model failure in one
step fails only that step's requests and the worker serves on; a cancel that overtakes its
request still drops it (real NATS and Valkey, a tiny random-weight engine)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import TypeVar, cast

import numpy as np
import pytest
import torch
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import BaseModel
from redis.asyncio import Redis

from services import liveness
from services.colocated.service import ColocatedService
from services.decode.service import DecodeService
from services.engine_host import EngineHost, thread_clock
from services.prefill.service import PrefillService
from services.process import WorkerSettings
from services.runtime import WorkerFailed
from shared import subjects
from shared.bus import connect, parse, publish
from shared.engine.block_manager import blocks_for
from shared.engine.config import EngineConfig, Role
from shared.engine.engine import Engine, RequestOutput
from shared.engine.kv_cache import MIB, Staging
from shared.engine.request import Draw, SamplingParams
from shared.engine.scheduler import SchedulerOutput, StepShape
from shared.kv_transfer import TransferError, wire
from shared.messages import (
    Cancel,
    KvReady,
    KvSource,
    PrefillRequest,
    ReleaseKv,
    Sampling,
    TokenChunk,
)
from shared.state import Registry


class BrokenEngine(Engine):
    def step(self) -> list[RequestOutput]:
        raise RuntimeError("the device fell over")


async def serving(worker: ColocatedService | DecodeService | PrefillService, stop: asyncio.Event,
                  redis_url: str) -> tuple[asyncio.Task[None], Registry]:
    """The worker running until `stop`, once it is registered."""
    running = asyncio.create_task(worker.run(stop))
    registry = Registry(Redis.from_url(redis_url))
    while not await registry.instances(worker.role):
        await asyncio.sleep(0.05)
    return running, registry


async def stop_serving(running: asyncio.Task[None], stop: asyncio.Event, registry: Registry,
                       nc: Client, subs: list[Subscription]) -> None:
    for sub in subs:
        await sub.unsubscribe()
    stop.set()
    await asyncio.wait_for(running, 30)  # drains and ends without WorkerFailed
    await nc.close()
    await registry.redis.aclose()


@pytest.mark.timeout(120)
def test_engine_failure_takes_the_worker_out_of_dispatch(nats_url: str, redis_url: str) -> None:
    settings = WorkerSettings(instance_id="colocated-x", nats_url=nats_url, redis_url=redis_url,
                              model="tiny", heartbeat_s=0.1)
    worker = ColocatedService(settings, BrokenEngine(EngineConfig(model="tiny")))

    async def main() -> None:
        stop = asyncio.Event()
        running, registry = await serving(worker, stop, redis_url)
        nc = await connect(nats_url, "test")
        await publish(nc, subjects.prefill("colocated-x"), PrefillRequest(
            request_id="r1", prompt_ids=[1, 2, 3], sampling=Sampling(max_tokens=2),
            arrival_ts=time.time()))
        with pytest.raises(WorkerFailed, match="engine loop"):
            await asyncio.wait_for(running, 30)
        assert await registry.instances("colocated") == []
        await nc.close()
        await registry.redis.aclose()

    asyncio.run(main())


def fail_once_for(monkeypatch: pytest.MonkeyPatch, engine: Engine, request_id: str) -> None:
    """The first step holding `request_id` raises in the model runner."""
    execute = engine.runner.execute
    armed = [True]

    def failing(out: SchedulerOutput) -> dict[str, tuple[int, float | None]]:
        if armed[0] and any(c.request.request_id == request_id for c in out.chunks):
            armed[0] = False
            raise RuntimeError("the device fell over")
        return execute(out)

    monkeypatch.setattr(engine.runner, "execute", failing)


async def send_and_wait(nc: Client, worker: str, request_id: str) -> list[TokenChunk]:
    """Send a short request; every chunk of it, up to its end (a finish reason or an error)."""
    chunks: asyncio.Queue[TokenChunk] = asyncio.Queue()

    async def on_chunk(msg: Msg) -> None:
        chunks.put_nowait(parse(msg, TokenChunk))

    sub = await nc.subscribe(subjects.tokens(request_id), cb=on_chunk)
    await publish(nc, subjects.prefill(worker), PrefillRequest(
        request_id=request_id, prompt_ids=[1, 2, 3], sampling=Sampling(max_tokens=4),
        arrival_ts=time.time()))
    received = [await asyncio.wait_for(chunks.get(), 30)]
    while received[-1].finish_reason is None and received[-1].error is None:
        received.append(await asyncio.wait_for(chunks.get(), 30))
    await sub.unsubscribe()
    return received


@pytest.mark.timeout(120)
def test_a_failed_step_fails_its_request_and_the_worker_serves_on(
        nats_url: str, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = WorkerSettings(instance_id="colocated-y", nats_url=nats_url, redis_url=redis_url,
                              model="tiny", heartbeat_s=0.1, heartbeat_ttl_s=0.5)
    engine = Engine(EngineConfig(model="tiny", device="cpu", kv_cache_bytes=1 << 20))
    fail_once_for(monkeypatch, engine, "bad")
    worker = ColocatedService(settings, engine)

    async def main() -> None:
        stop = asyncio.Event()
        running, registry = await serving(worker, stop, redis_url)
        nc = await connect(nats_url, "test")
        (failed,) = await send_and_wait(nc, "colocated-y", "bad")
        assert failed.error is not None and "the device fell over" in failed.error
        assert failed.finish_reason is None and not failed.token_ids
        good = await send_and_wait(nc, "colocated-y", "good")
        assert good[-1].finish_reason == "length" and all(c.error is None for c in good)
        assert sum(len(c.token_ids) for c in good) == 4
        assert not running.done() and worker.known == {}
        assert engine.blocks.num_free == engine.blocks.num_blocks
        await stop_serving(running, stop, registry, nc, [])

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_a_worker_whose_engine_step_never_ends_stops_showing_alive(
        nats_url: str, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step wedged on the engine thread (the model call blocks) while the event loop and
    the heartbeats turn on: past `step_timeout_s` the worker no longer touches its alive
    file (its supervisor then kills it as hung), and touches it again once the step ends.
    Before, a wedged step kept it shown alive for ever, holding its KV memory."""
    alive = tmp_path / "colocated-w.alive"
    settings = WorkerSettings(instance_id="colocated-w", nats_url=nats_url, redis_url=redis_url,
                              model="tiny", heartbeat_s=0.1, alive_file=str(alive),
                              step_timeout_s=1.0)
    engine = Engine(EngineConfig(model="tiny", device="cpu", kv_cache_bytes=1 << 20))
    execute, release = engine.runner.execute, threading.Event()

    def wedged(out: SchedulerOutput) -> dict[str, tuple[int, float | None]]:
        if any(c.request.request_id == "wedged" for c in out.chunks):
            release.wait(60)
        return execute(out)

    monkeypatch.setattr(engine.runner, "execute", wedged)
    worker = ColocatedService(settings, engine)

    def touched() -> int:
        return alive.stat().st_mtime_ns if alive.exists() else 0

    async def main() -> None:
        stop = asyncio.Event()
        running, registry = await serving(worker, stop, redis_url)
        nc = await connect(nats_url, "test")
        while not touched():
            await asyncio.sleep(0.05)
        waiting = asyncio.create_task(send_and_wait(nc, "colocated-w", "wedged"))
        try:
            while worker.host.busy_since == 0:
                await asyncio.sleep(0.01)
            await asyncio.sleep(2.5)  # past the step timeout and a touch (every second)
            before, ticks = touched(), worker.ticks
            await asyncio.sleep(2.5)
            assert worker.ticks > ticks  # the loop turns ...
            assert touched() == before  # ... but the step does not end: not shown alive
            assert await registry.instances("colocated")  # (its heartbeats go on)
        finally:
            release.set()
        chunks = await waiting
        assert chunks[-1].finish_reason == "length"
        await asyncio.sleep(2.5)
        assert touched() > before  # the step ended: alive again
        await stop_serving(running, stop, registry, nc, [])

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_a_worker_no_supervisor_watches_leaves_once_its_engine_step_never_ends(
        nats_url: str, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under docker-compose no supervisor watches an alive file: a worker whose engine step
    has run past `step_timeout_s` exits itself (code 70, from its heartbeat thread), for its
    container's restart policy to bring it back; a step under the timeout does not. Before,
    a wedged step there held the worker, its KV memory and its place for ever. Stopped
    while wedged, it leaves at once once its engine has not closed within the timeout
    (before, its exit joined the wedged engine thread: it never ended)."""
    settings = WorkerSettings(instance_id="colocated-u", nats_url=nats_url, redis_url=redis_url,
                              model="tiny", heartbeat_s=0.1, step_timeout_s=2.0,
                              drain_timeout_s=1.0)
    assert not settings.alive_file
    engine = Engine(EngineConfig(model="tiny", device="cpu", kv_cache_bytes=1 << 20))
    execute, release, left = engine.runner.execute, threading.Event(), threading.Event()
    codes: list[int] = []

    def wedged(out: SchedulerOutput) -> dict[str, tuple[int, float | None]]:
        if any(c.request.request_id == "wedged" for c in out.chunks):
            release.wait(60)
        return execute(out)

    def exit_now(code: int) -> None:  # instead of os._exit: the test runs in this process
        codes.append(code)
        left.set()

    monkeypatch.setattr(engine.runner, "execute", wedged)
    monkeypatch.setattr(liveness, "exit_now", exit_now)
    worker = ColocatedService(settings, engine)

    async def main() -> None:
        stop = asyncio.Event()
        running, registry = await serving(worker, stop, redis_url)
        nc = await connect(nats_url, "test")
        waiting = asyncio.create_task(send_and_wait(nc, "colocated-u", "wedged"))
        try:
            while worker.host.busy_since == 0:
                await asyncio.sleep(0.01)
            await asyncio.sleep(1.0)
            assert not codes  # under the timeout
            assert await asyncio.to_thread(left.wait, 30), "the worker did not leave"
            assert codes == [liveness.HUNG]
            assert time.time() - worker.host.busy_since >= 2.0  # not before the timeout
            left.clear()
            stop.set()  # still wedged (the test's exit_now did not end it)
            assert await asyncio.to_thread(left.wait, 30), "the stopped worker did not leave"
            assert codes == [liveness.HUNG] * 2
        finally:
            release.set()
        await asyncio.wait_for(running, 30)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await nc.close()
        await registry.redis.aclose()

    asyncio.run(main())


def test_a_step_timeout_under_the_collective_timeout_is_named_for_a_parallel_instance() -> None:
    assert liveness.step_timeout_problem(900, 600, ranks=2) is None
    assert liveness.step_timeout_problem(300, 600, ranks=1) is None  # no collective to wait
    assert liveness.step_timeout_problem(0, 600, ranks=4) is None  # never timed out
    problem = liveness.step_timeout_problem(600, 600, ranks=2)
    assert problem is not None and problem.startswith("DS_STEP_TIMEOUT_S (600 s) is not above")


def watchdog(stuck_since: Callable[[], float] = lambda: 0.0, step_s: float = 0.0,
             ticks: Callable[[], int] | None = None, hang_s: float | None = None,
             stopping: Callable[[], bool] = lambda: False, code: int = liveness.HUNG,
             clock: Callable[[], float] = time.monotonic) -> float:
    """`leave_when_stuck` in rounds of 10 ms, for at most 0.5 s; the seconds it ran (its exit
    is the test's patched `exit_now`)."""
    async def main() -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(liveness.leave_when_stuck(
                stuck_since, step_s, lambda: code, "w", ticks, hang_s, stopping,
                every_s=0.01, clock=clock), 0.5)
    started = time.monotonic()
    asyncio.run(main())
    return time.monotonic() - started


def test_the_watchdog_counts_one_steps_time_awake_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """`leave_when_stuck` leaves once the engine has been at the same thing for the step
    timeout by its own monotonic count: steps that keep ending never add up, and rounds that
    overslept (the process paused, the host suspended) count for nothing."""
    codes: list[int] = []
    monkeypatch.setattr(liveness, "exit_now", codes.append)

    def watch(stuck_since: Callable[[], float],
              clock: Callable[[], float] = time.monotonic) -> None:
        watchdog(stuck_since, 0.05, code=3, clock=clock)

    watch(lambda: 100.0)
    assert codes == [3]  # the code it is given (DRAINED: asked to leave)
    steps = itertools.count(1)
    watch(lambda: float(next(steps)))  # a new step each round
    watch(lambda: 0.0)  # idle
    rounds = itertools.count()
    jumps = itertools.count(0.0, liveness.PAUSED_S)  # every round oversleeps
    watch(lambda: next(rounds) and 100.0, clock=lambda: next(jumps))
    assert codes == [3] and next(rounds) > 20  # it did go round


def test_the_watchdog_counts_a_held_event_loop_apart_from_the_engine(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Past `hang_s` without a turn of its main loop (`ticks`) a worker no supervisor watches
    leaves too, its engine idle; a loop that turns never adds up, nor do rounds that
    overslept; with neither timeout there is nothing to watch, nor once the worker stops in
    order (or the program running it in-process ends it: a test's worker must not end the
    test run a minute later)."""
    codes: list[int] = []
    monkeypatch.setattr(liveness, "exit_now", codes.append)

    def watch(ticks: Callable[[], int], hang_s: float | None = 0.05,
              clock: Callable[[], float] = time.monotonic,
              stopping: Callable[[], bool] = lambda: False) -> float:
        return watchdog(ticks=ticks, hang_s=hang_s, stopping=stopping, clock=clock)

    assert watch(lambda: 7) < 0.4 and codes == [liveness.HUNG]  # held: no turn since
    turns = itertools.count()
    watch(lambda: next(turns))  # turning
    rounds = itertools.count()
    jumps = itertools.count(0.0, liveness.PAUSED_S)  # every round oversleeps
    watch(lambda: 7 + 0 * next(rounds), clock=lambda: next(jumps))
    assert codes == [liveness.HUNG] and next(rounds) > 20  # it did go round
    assert watch(lambda: 7, hang_s=None) < 0.1  # nothing to watch: returns at once
    assert watch(lambda: 7, stopping=lambda: True) < 0.4  # stopping: returns, judging nothing
    assert codes == [liveness.HUNG]


@pytest.mark.timeout(120)
def test_a_worker_no_supervisor_watches_leaves_once_its_event_loop_is_held(
        nats_url: str, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under docker-compose: a worker whose event loop is held by a call that never returns
    (the GIL released: its heartbeats beat on from their own thread, so it looks live) while
    its engine idles exits itself past DS_HANG_TIMEOUT_S (code 70), as a supervisor would
    have killed it; before, it stayed so for good, its requests going nowhere."""
    monkeypatch.setenv("DS_HANG_TIMEOUT_S", "3")
    settings = WorkerSettings(instance_id="colocated-h", nats_url=nats_url, redis_url=redis_url,
                              model="tiny", heartbeat_s=0.1, drain_timeout_s=1.0)
    assert not settings.alive_file
    worker = ColocatedService(settings, Engine(EngineConfig(model="tiny", device="cpu",
                                                            kv_cache_bytes=1 << 20)))
    release, codes = threading.Event(), []

    def exit_now(code: int) -> None:  # instead of os._exit: the test runs in this process
        codes.append(code)
        release.set()

    monkeypatch.setattr(liveness, "exit_now", exit_now)

    async def main() -> None:
        stop = asyncio.Event()
        running, registry = await serving(worker, stop, redis_url)
        await asyncio.sleep(4.0)
        assert not codes  # a loop that turns, an engine that idles: it stays
        held = time.monotonic()
        asyncio.get_running_loop().call_soon(release.wait, 60)  # holds this loop
        await asyncio.sleep(0)
        waited = time.monotonic() - held
        assert codes == [liveness.HUNG], f"not left after {waited:.1f} s"
        # past the hang timeout, not before (counted from the last turn the watchdog saw,
        # which may be up to a tick, 0.5 s, before the loop was held)
        assert 2.5 <= waited < 30
        stop.set()
        await asyncio.wait_for(running, 30)
        await registry.redis.aclose()

    asyncio.run(main())


def test_a_call_wedged_on_the_engine_thread_is_what_the_engine_is_stuck_at() -> None:
    """Not only a step: a call on the engine thread (a KV export or import, a request taken
    in) that never returns counts from when it began; nothing running counts as 0."""
    host = EngineHost(Engine(EngineConfig(model="tiny", device="cpu", kv_cache_bytes=1 << 20)))
    release = threading.Event()

    async def main() -> None:
        assert host.stuck_since() == 0.0
        began = time.time()
        call = asyncio.ensure_future(host.call(release.wait, 30))
        try:
            await asyncio.sleep(0.3)
            assert began <= host.stuck_since() <= began + 0.3
        finally:
            release.set()
        await call
        assert host.stuck_since() == 0.0

    asyncio.run(main())


async def chunks_of(nc: Client, request_ids: list[str]
                    ) -> tuple[list[TokenChunk], list[Subscription]]:
    """Every chunk that comes for `request_ids` (a list that fills), and the subscriptions."""
    seen: list[TokenChunk] = []

    async def on_chunk(msg: Msg) -> None:
        seen.append(parse(msg, TokenChunk))

    return seen, [await nc.subscribe(subjects.tokens(r), cb=on_chunk) for r in request_ids]


W = TypeVar("W", ColocatedService, DecodeService, PrefillService)


def tiny(kind: type[W], instance_id: str, nats_url: str, redis_url: str) -> W:
    """A worker of `kind` on a tiny random-weight engine in its role."""
    settings = WorkerSettings(instance_id=instance_id, nats_url=nats_url, redis_url=redis_url,
                              model="tiny", heartbeat_s=0.1)
    config = EngineConfig(model="tiny", device="cpu").with_scheduler(role=kind.engine_role)
    return kind(settings, Engine(config))


async def until(condition: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        await asyncio.sleep(0.01)


async def until_idle(worker: ColocatedService | DecodeService | PrefillService,
                     timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not worker.idle() or worker.engine.has_work():
        assert time.monotonic() < deadline, "the worker never went idle"
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def worker_serving(worker: ColocatedService | DecodeService, nats_url: str, redis_url: str,
                         request_ids: list[str]
                         ) -> AsyncIterator[tuple[Client, list[TokenChunk]]]:
    """`worker` serving; a client connection and the chunks of `request_ids`; the worker
    stopped after the body."""
    stop = asyncio.Event()
    running, registry = await serving(worker, stop, redis_url)
    nc = await connect(nats_url, "test")
    seen, subs = await chunks_of(nc, request_ids)
    yield nc, seen
    await stop_serving(running, stop, registry, nc, subs)


@contextlib.asynccontextmanager
async def engine_held(worker: ColocatedService | DecodeService | PrefillService
                      ) -> AsyncIterator[None]:
    """The worker's engine thread busy (as in a long step) for the body: what the service
    hands it meanwhile waits there, in order."""
    held, gate = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        gate.wait(60)

    busy = asyncio.ensure_future(worker.host.call(hold))
    try:
        await until(held.is_set)
        yield
    finally:
        gate.set()  # also when the body failed: the engine thread is not left waiting
    await busy


@pytest.mark.timeout(120)
def test_a_request_whose_cancel_overtakes_it_never_runs(nats_url: str, redis_url: str) -> None:
    """NATS hands the prompts and the cancels to separate tasks, and taking a prompt in waits
    for the engine's step: a cancel read before its prompt, or while the prompt is being
    taken in, still drops it (it used to run to its end, its KV held, nobody listening).
    Every cancel is read while the engine thread is busy: one waiting for its abort used to
    hold back the next, read only after the engine had stepped the request it named."""
    worker = tiny(ColocatedService, "colocated-z", nats_url, redis_url)

    async def main() -> None:
        ids = ["first", "during", "named"]
        async with worker_serving(worker, nats_url, redis_url, ids) as (nc, seen):
            long = Sampling(max_tokens=64, ignore_eos=True)
            await publish(nc, subjects.CANCEL_ALL, Cancel(request_id="first"))
            await publish(nc, subjects.prefill("colocated-z"), PrefillRequest(
                request_id="first", prompt_ids=[1, 2, 3], sampling=long, arrival_ts=time.time()))
            async with engine_held(worker):  # the next prompts wait there to be taken in
                for request_id in ("during", "named"):
                    await publish(nc, subjects.prefill("colocated-z"), PrefillRequest(
                        request_id=request_id, prompt_ids=[4, 5, 6], sampling=long,
                        arrival_ts=time.time()))
                await until(lambda: {"during", "named"} <= worker.known.keys())
                await publish(nc, subjects.CANCEL_ALL, Cancel(request_id="during"))
                # moved away from this worker at its attempt 0
                await publish(nc, subjects.CANCEL_ALL, Cancel(request_id="named",
                                                              instance="colocated-z", attempt=0))
                await until(lambda: not {"during", "named"} & worker.known.keys())  # both read
            good = await send_and_wait(nc, "colocated-z", "after")  # served after both
            assert good[-1].finish_reason == "length"
            await until_idle(worker)
            assert seen == []  # none ran: not a token of any
            assert "first" in worker.cancelled and "during" in worker.cancelled
            assert worker.known == {} and worker.attempts == {}

    asyncio.run(main())


def message(body: BaseModel) -> Msg:
    """A NATS message carrying `body`, for a callback called directly."""
    return cast(Msg, SimpleNamespace(data=body.model_dump_json().encode(), headers=None,
                                     reply=""))


@pytest.mark.timeout(120)
def test_a_burst_of_cancels_is_read_while_the_engine_steps() -> None:
    """Clients that leave together: each cancel's callback returns while the engine thread is
    busy, and none of the prompts is left in the engine. The callback used to await the
    abort, and NATS holds a subscription's next message until its callback returns: a burst
    was read one cancel a step, the engine prefilling the rest meanwhile. The callbacks are
    called directly (no NATS): a prefill instance's KV listener must be the first UCX user
    of its process, which it is not after a suite's earlier tests."""
    worker = tiny(PrefillService, "prefill-c", "nats://unused", "redis://unused")
    ids = [f"left-{i}" for i in range(3)]

    async def main() -> None:
        async with engine_held(worker):
            for request_id in ids:
                await worker._on_request(message(PrefillRequest(
                    request_id=request_id, prompt_ids=[1, 2, 3], decode_instance="decode-c",
                    sampling=Sampling(max_tokens=4, ignore_eos=True), arrival_ts=time.time())))
            for request_id in ids:  # each returns with the engine still held
                await asyncio.wait_for(worker._on_cancel(message(Cancel(request_id=request_id))),
                                       10)
            assert not set(ids) & worker.requests.keys()
        await until(lambda: not worker.in_hand)  # the admissions and the aborts ran
        assert not worker.engine.has_work()

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_a_cancel_read_while_its_attempt_is_taken_in_leaves_a_newer_attempt_running(
        nats_url: str, redis_url: str) -> None:
    """Attempt 0 waits on the engine thread to be taken in; the gateway moves the request
    away (a cancel of attempt 0 here) and back (attempt 1) meanwhile. When attempt 0's
    admission returns and sees its cancel, it drops its own copy only: it used to abort the
    request's id, after attempt 1 had been taken in, and attempt 1 never ran."""
    worker = tiny(ColocatedService, "colocated-n", nats_url, redis_url)

    async def main() -> None:
        async with worker_serving(worker, nats_url, redis_url, ["again"]) as (nc, seen):
            sampling = Sampling(max_tokens=6, ignore_eos=True)
            async with engine_held(worker):
                await publish(nc, subjects.prefill("colocated-n"), PrefillRequest(
                    request_id="again", prompt_ids=[1, 2, 3], sampling=sampling,
                    arrival_ts=time.time()))
                await until(lambda: worker.known.get("again") == 0)
                await publish(nc, subjects.CANCEL_ALL, Cancel(request_id="again",
                                                              instance="colocated-n", attempt=0))
                await until(lambda: "again" not in worker.known)
                await publish(nc, subjects.prefill("colocated-n"), PrefillRequest(
                    request_id="again", prompt_ids=[1, 2, 3], sampling=sampling, attempt=1,
                    arrival_ts=time.time()))
                await until(lambda: worker.known.get("again") == 1)
            await until(lambda: any(c.finish_reason or c.error for c in seen))
            await until_idle(worker)
            assert [c.attempt for c in seen] == [1] * 6 and seen[-1].finish_reason == "length"
            assert worker.known == {} and worker.attempts == {}

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_a_late_cancel_of_an_older_attempt_leaves_the_newer_one_running(
        nats_url: str, redis_url: str) -> None:
    """The gateway moved a request away from this worker (a cancel naming attempt 0 here)
    and later back (attempt 1): the cancel and the new attempt travel apart, so the cancel
    can come second. It drops attempt 0 only; attempt 1 runs to its end (it used to be
    aborted, the client's stream stalled until the gateway moved it once more). An older
    attempt arriving after a newer one is dropped as stale, not run over it."""
    worker = tiny(ColocatedService, "colocated-l", nats_url, redis_url)

    async def main() -> None:
        async with worker_serving(worker, nats_url, redis_url, ["back"]) as (nc, seen):
            for attempt in (1, 0):  # the newer first; the older, stale, after it
                await publish(nc, subjects.prefill("colocated-l"), PrefillRequest(
                    request_id="back", prompt_ids=[1, 2, 3], attempt=attempt,
                    sampling=Sampling(max_tokens=48, ignore_eos=True), arrival_ts=time.time()))
            await until(lambda: worker.attempts.get("back") == 1)  # the engine has attempt 1
            await publish(nc, subjects.CANCEL_ALL, Cancel(request_id="back",
                                                          instance="colocated-l", attempt=0))
            await until(lambda: worker.cancelled.covers("back", 0))
            await until(lambda: any(c.finish_reason or c.error for c in seen))  # its last chunk
            await until_idle(worker)
            assert seen and seen[-1].finish_reason == "length"  # not aborted
            assert {c.attempt for c in seen} == {1}  # attempt 0 never ran
            assert sum(len(c.token_ids) for c in seen) == 48
            # ended: a late copy of attempt 1 would not run again, a later attempt would
            assert worker.cancelled.covers("back", 1) and not worker.cancelled.covers("back", 2)
            assert worker.known == {}

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_prompts_that_arrive_during_a_step_all_go_into_the_next(nats_url: str,
                                                               redis_url: str) -> None:
    """Taking a prompt in waits for the step under way, and NATS hands a subscription's
    messages to its callback one at a time: awaited in the callback, each admission let one
    prompt into the engine a step (here the first step took two of the four). Four
    prompts that arrive while the engine thread is busy now go into its next step together,
    in the order they came."""
    worker = tiny(ColocatedService, "colocated-b", nats_url, redis_url)
    ids = [f"burst-{i}" for i in range(4)]

    async def main() -> None:
        async with worker_serving(worker, nats_url, redis_url, ids) as (nc, seen):
            gate = threading.Event()
            busy = asyncio.ensure_future(worker.host.call(gate.wait, 60))  # a step under way
            for i, request_id in enumerate(ids):
                await publish(nc, subjects.prefill("colocated-b"), PrefillRequest(
                    request_id=request_id, prompt_ids=list(range(1, 4 + i)),
                    sampling=Sampling(max_tokens=4, ignore_eos=True), arrival_ts=time.time()))
            deadline = time.monotonic() + 10
            while set(worker.known) != set(ids) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # every prompt handed over (or, before, the first)
            gate.set()
            await busy
            await until(lambda: sum(bool(c.finish_reason or c.error) for c in seen) == len(ids))
            await until_idle(worker)
            prefills = [shape.prompts for _, shape, _, _ in worker.host.samples if shape.prompts]
            assert prefills[0] == (3, 4, 5, 6)  # all four, in arrival order
            assert {c.request_id for c in seen if c.finish_reason == "length"} == set(ids)

    asyncio.run(main())


async def releases_to(nc: Client, prefill: str) -> asyncio.Queue[ReleaseKv]:
    """The `ReleaseKv`s decode instances send the prefill instance `prefill`, answered."""
    released: asyncio.Queue[ReleaseKv] = asyncio.Queue()

    async def on_release(msg: Msg) -> None:
        released.put_nowait(parse(msg, ReleaseKv))
        await msg.respond(b"")

    await nc.subscribe(subjects.release(prefill), cb=on_release)
    return released


@contextlib.asynccontextmanager
async def decode_serving(worker: DecodeService, nats_url: str, redis_url: str, prefill: str,
                         request_ids: list[str]
                         ) -> AsyncIterator[tuple[Client, asyncio.Queue[ReleaseKv],
                                                  list[TokenChunk]]]:
    """`worker` serving; a client connection, the releases sent to the prefill instance
    `prefill` and the chunks of `request_ids`; the worker stopped after the body."""
    async with worker_serving(worker, nats_url, redis_url, request_ids) as (nc, seen):
        yield nc, await releases_to(nc, prefill), seen


def announcement(request_id: str, prefill: str, token: str, attempt: int = 0) -> KvReady:
    """A prefill instance's announcement of a 3-token prompt's KV (one block), 16 tokens."""
    return KvReady(request_id=request_id, prefill_instance=prefill, token=token,
                   sources=[KvSource(address="127.0.0.1:9", layers=(0, 2), kv_heads=(0, 2))],
                   num_blocks=1, prompt_ids=[1, 2, 3], output_ids=[4], computed=3,
                   sampling=Sampling(max_tokens=16, ignore_eos=True), arrival_ts=time.time(),
                   first_token_ts=time.time(), attempt=attempt)


@pytest.mark.timeout(120)
def test_a_decode_instance_releases_the_kv_of_a_request_cancelled_before_its_announcement(
        nats_url: str, redis_url: str) -> None:
    """The announcement of a request the client already left, or of an attempt the gateway
    moved away from this instance, is not pulled: the prefill instance is told at once that
    it may free the KV."""
    worker = tiny(DecodeService, "decode-z", nats_url, redis_url)

    async def main() -> None:
        async with decode_serving(worker, nats_url, redis_url, "prefill-gone",
                                  ["left", "moved"]) as (nc, released, seen):
            # the client went away; the gateway moved the other away from here at attempt 1
            for request_id, cancel in (("left", Cancel(request_id="left")),
                                       ("moved", Cancel(request_id="moved", instance="decode-z",
                                                        attempt=1))):
                await publish(nc, subjects.CANCEL_ALL, cancel)
                while not worker.cancelled.covers(request_id, 1):
                    await asyncio.sleep(0.01)
                await publish(nc, subjects.decode("decode-z"),
                              announcement(request_id, "prefill-gone", "t", attempt=1))
                release = await asyncio.wait_for(released.get(), 30)
                assert (release.request_id, release.attempt) == (request_id, 1)
            assert "left" in worker.cancelled and not worker.cancelled.covers("moved", 2)
            await until_idle(worker)
            assert seen == [] and not worker.pending and not worker.pulling
            assert worker.kv_client.stats.requests == 0  # never pulled

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_a_newer_attempt_announced_during_an_older_ones_pull_supersedes_it(
        nats_url: str, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway moved a request away while this instance still pulled its KV (attempt
    0), then back (attempt 1). The older pull is cancelled when the newer is announced, its
    blocks freed and its KV released; only attempt 1 decodes. (Both pulls used to run, the
    newer one's task overwriting the older's in `pulling`: whichever imported last ran, a
    cancel of attempt 0 could no longer reach its pull, and its blocks were freed by no one
    but its own end.) An announcement of attempt 0 that comes after attempt 1's is stale:
    released, not pulled. The transfer is held by hand here, as a slow prefill host would."""
    worker = tiny(DecodeService, "decode-n", nats_url, redis_url)
    held = asyncio.Event()
    pulls: list[str] = []

    async def pull(client: object, request_id: str, token: str, *rest: object) -> None:
        pulls.append(token)
        if token == "t0":
            held.set()
            await asyncio.Event().wait()  # never lands: cancelled, or the test fails

    monkeypatch.setattr("services.decode.service.pull_pieces", pull)

    async def main() -> None:
        async with decode_serving(worker, nats_url, redis_url, "prefill-slow",
                                  ["back"]) as (nc, released, seen):
            free = worker.engine.blocks.num_free
            for attempt, token in ((0, "t0"), (1, "t1"), (0, "late")):  # the last one stale
                await publish(nc, subjects.decode("decode-n"),
                              announcement("back", "prefill-slow", token, attempt))
                if attempt == 0:
                    await asyncio.wait_for(held.wait(), 30)  # attempt 0's pull under way
            releases = [await asyncio.wait_for(released.get(), 30) for _ in range(3)]
            assert sorted((r.request_id, r.attempt) for r in releases) == [
                ("back", 0), ("back", 0), ("back", 1)]
            await until(lambda: bool(seen) and seen[-1].finish_reason is not None)
            await until_idle(worker)
            assert pulls == ["t0", "t1"]  # the late, stale attempt 0 was not pulled
            assert seen and seen[-1].finish_reason == "length"
            assert {c.attempt for c in seen} == {1}  # attempt 0 never decoded
            assert sum(len(c.token_ids) for c in seen) == 15  # all but the first, sampled before
            assert not worker.pulling and not worker.freeing
            assert worker.engine.blocks.num_free == free  # neither pull's blocks leaked

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_a_request_taken_back_while_its_older_copy_decodes_streams_only_the_new_copy(
        nats_url: str, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Attempt 0 decodes here; the gateway moves the request and it comes back (attempt 1,
    resuming after its first token) while a step of attempt 0 is under way. That step's
    output is attempt 0's (labelled by request id, it went out as attempt 1 at attempt 0's
    index: a gap to the gateway, a move for nothing); attempt 1's tokens follow on from
    its own first one."""
    worker = tiny(DecodeService, "decode-b", nats_url, redis_url)
    execute, gate, blocked = worker.engine.runner.execute, threading.Event(), threading.Event()
    steps = [0]

    async def pull(*_: object) -> None:
        pass

    def held(out: SchedulerOutput) -> dict[str, tuple[int, float | None]]:
        steps[0] += 1
        if steps[0] == 6:  # attempt 0's sixth step is under way when attempt 1 lands
            blocked.set()
            gate.wait(60)
        return execute(out)

    monkeypatch.setattr("services.decode.service.pull_pieces", pull)
    monkeypatch.setattr(worker.engine.runner, "execute", held)
    longer = Sampling(max_tokens=40, ignore_eos=True)

    async def main() -> None:
        async with decode_serving(worker, nats_url, redis_url, "prefill-b",
                                  ["back"]) as (nc, _, seen):
            try:
                await publish(nc, subjects.decode("decode-b"), announcement(
                    "back", "prefill-b", "t0", 0).model_copy(update={"sampling": longer}))
                await until(blocked.is_set)
                await publish(nc, subjects.decode("decode-b"), announcement(
                    "back", "prefill-b", "t1", 1).model_copy(update={"sampling": longer}))
                await until(lambda: worker.attempts.get("back") == 1)  # pulled, not in yet
            finally:
                gate.set()
            await until(lambda: any(c.attempt == 1 and c.finish_reason for c in seen))
            await until_idle(worker)
            resumed = [c.seq for c in seen if c.attempt == 1 and c.token_ids]
            assert resumed == list(range(1, 40))  # from its own first token, no gap
            assert sum(len(c.token_ids) for c in seen if c.attempt == 1) == 39

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_a_colocated_worker_keeps_a_newer_attempt_when_the_older_copy_ends(
        nats_url: str, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Attempt 1 of a request arrives while the step that ends attempt 0 is under way: that
    end is attempt 0's, and the worker still knows attempt 1 as the one it serves (it
    forgot it: a cancel of attempt 1 was then ignored, and it ran on unheard)."""
    worker = tiny(ColocatedService, "colocated-k", nats_url, redis_url)
    execute, gate, blocked = worker.engine.runner.execute, threading.Event(), threading.Event()
    steps = [0]

    def held(out: SchedulerOutput) -> dict[str, tuple[int, float | None]]:
        steps[0] += 1
        if steps[0] == 4:  # the step of attempt 0's fourth and last token
            blocked.set()
            gate.wait(60)
        return execute(out)

    monkeypatch.setattr(worker.engine.runner, "execute", held)

    def request(attempt: int, max_tokens: int) -> PrefillRequest:
        return PrefillRequest(request_id="k", prompt_ids=[1, 2, 3], attempt=attempt,
                              sampling=Sampling(max_tokens=max_tokens, ignore_eos=True),
                              arrival_ts=time.time())

    async def main() -> None:
        async with worker_serving(worker, nats_url, redis_url, ["k"]) as (nc, seen):
            try:
                await publish(nc, subjects.prefill("colocated-k"), request(0, 4))
                await until(blocked.is_set)
                await publish(nc, subjects.prefill("colocated-k"), request(1, 200))
                await until(lambda: worker.known.get("k") == 1)
            finally:
                gate.set()
            await until(lambda: any(c.attempt == 0 and c.finish_reason for c in seen))
            assert worker.known.get("k") == 1  # attempt 1 runs on, known
            await publish(nc, subjects.CANCEL_ALL, Cancel(request_id="k"))
            await until(lambda: "k" not in worker.known)
            await until_idle(worker)

    asyncio.run(main())


def test_a_worker_heartbeats_each_request_it_holds_with_its_attempt(
        nats_url: str, redis_url: str) -> None:
    """A gateway moves a request its instance no longer holds (its chunks were lost): the
    heartbeat lists every request held, in any form, as the attempt held."""
    decode = tiny(DecodeService, "decode-h", nats_url, redis_url)
    decode.pending.append(announcement("queued", "p", "t", attempt=2))
    decode.pulling["pulled"] = (1, cast(asyncio.Task[None], None))
    decode.attempts["running"] = 0
    assert decode.info().held == {"queued": 2, "pulled": 1, "running": 0}
    prefill = tiny(PrefillService, "prefill-h", nats_url, redis_url)
    prefill.requests["parked"] = PrefillRequest(request_id="parked", prompt_ids=[1], attempt=3,
                                                sampling=Sampling(max_tokens=2),
                                                arrival_ts=time.time())
    assert prefill.info().held == {"parked": 3}
    colocated = tiny(ColocatedService, "colocated-h", nats_url, redis_url)
    colocated.subscriptions()  # sets up what it keeps of its requests
    colocated.known["taken"] = 4
    assert colocated.info().held == {"taken": 4}


@pytest.mark.timeout(120)
def test_an_announcement_heard_twice_is_acknowledged_each_time_and_pulled_once(
        nats_url: str, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill instance sends its announcement again where no acknowledgement came (it
    was lost, or only its answer was): the copy is acknowledged too, and neither a copy
    heard while the request decodes nor one heard after it ended runs it again."""
    worker = tiny(DecodeService, "decode-a", nats_url, redis_url)
    pulls: list[str] = []

    async def pull(client: object, request_id: str, token: str, *rest: object) -> None:
        pulls.append(token)

    monkeypatch.setattr("services.decode.service.pull_pieces", pull)

    async def main() -> None:
        async with decode_serving(worker, nats_url, redis_url, "prefill-twice",
                                  ["twice"]) as (nc, released, seen):
            data = announcement("twice", "prefill-twice", "t").model_dump_json().encode()
            for _ in range(2):  # both answered: nats-py raises where none comes
                await nc.request(subjects.decode("decode-a"), data, timeout=10)
            await until(lambda: bool(seen) and seen[-1].finish_reason is not None)
            await nc.request(subjects.decode("decode-a"), data, timeout=10)  # after its end
            release = await asyncio.wait_for(released.get(), 30)
            assert (release.request_id, release.attempt) == ("twice", 0)
            await until_idle(worker)
            assert pulls == ["t"]
            assert sum(len(c.token_ids) for c in seen) == 15  # decoded once

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_an_announcement_no_decode_instance_acknowledges_asks_the_gateway_to_move_it(
        nats_url: str, redis_url: str) -> None:
    """NATS delivers at most once: an announcement lost as the connection dropped left its
    request waiting, the decode instance busy with others, for the client's timeout. Never
    acknowledged, it is a failed handoff the gateway moves (the KV stays for the move)."""
    worker = tiny(PrefillService, "prefill-u", nats_url, redis_url)
    worker.settings = worker.settings.model_copy(update={"dispatch_ack_s": 0.2,
                                                         "dispatch_tries": 2})

    async def main() -> None:
        worker.nc = await connect(nats_url, "prefill-u")
        nc = await connect(nats_url, "test")
        seen, subs = await chunks_of(nc, ["unheard"])
        ready = announcement("unheard", "prefill-u", "t", 2)
        await worker._deliver("decode-nobody", ready, None)  # not held here (any more)
        await asyncio.sleep(0.3)
        assert seen == []  # ended here meanwhile: nobody to move
        worker.requests["unheard"] = PrefillRequest(request_id="unheard", prompt_ids=[1, 2, 3],
                                                    attempt=2, arrival_ts=time.time(),
                                                    sampling=Sampling(max_tokens=4))
        started = time.monotonic()
        await worker._deliver("decode-nobody", ready, None)
        await until(lambda: bool(seen))
        (chunk,) = seen
        assert (chunk.retry, chunk.attempt, chunk.seq) == (True, 2, 1)
        assert chunk.error is not None and "decode-nobody never acknowledged" in chunk.error
        assert time.monotonic() - started >= 0.2  # tried again before giving up
        for sub in subs:
            await sub.unsubscribe()
        await nc.close()
        await worker.nc.close()

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_on_the_cpu_a_pull_starts_beside_the_step_under_way_and_joins_the_next(
        nats_url: str, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode instance of one rank on the CPU takes a pull's blocks at once, not after the
    step under way (an engine call waits for it): the pull runs beside that step, and only
    the admission waits for it, so the request decodes in the next step. Taken on the
    engine thread, a request heard mid-step ran a step later (0-2% of those of a humaneval
    run joined the next step, 57-60% since). Here a real decode step is held mid-way."""
    worker = tiny(DecodeService, "decode-m", nats_url, redis_url)
    assert worker.engine.blocks_off_thread
    execute = worker.engine.runner.execute
    in_step, go_on = threading.Event(), threading.Event()
    pulled: dict[str, int] = {}  # request -> free blocks as its pull ran

    def held_step(out: SchedulerOutput) -> dict[str, Draw]:
        if not go_on.is_set():
            in_step.set()
            go_on.wait(60)
        return execute(out)

    async def pull(_: object, request_id: str, *rest: object) -> None:  # lands at once
        pulled[request_id] = worker.engine.blocks.num_free

    monkeypatch.setattr(worker.engine.runner, "execute", held_step)
    monkeypatch.setattr("services.decode.service.pull_pieces", pull)

    async def main() -> None:
        async with decode_serving(worker, nats_url, redis_url, "prefill-m",
                                  ["long", "mid"]) as (nc, released, seen):
            free = worker.engine.blocks.num_free
            try:
                await publish(nc, subjects.decode("decode-m"),
                              announcement("long", "prefill-m", "t"))
                await until(in_step.is_set)  # its first step, under way
                steps = worker.host.steps
                await publish(nc, subjects.decode("decode-m"),
                              announcement("mid", "prefill-m", "u"))
                await until(lambda: "mid" in pulled, timeout=10)  # beside the step
                assert pulled["mid"] == free - 2  # its block taken beside the step
                assert worker.engine.scheduler.get("mid") is None  # admitted after it
            finally:
                go_on.set()
            for _ in range(2):
                await asyncio.wait_for(released.get(), 30)
            await until(lambda: sum(c.finish_reason is not None for c in seen) == 2)
            await until_idle(worker)
            batches = {n: shape.batch for n, shape, _, _ in worker.host.samples}
            assert batches[steps + 1] == 1 and batches[steps + 2] == 2  # mid: the next step
            assert {c.attempt for c in seen} == {0} and \
                sum(len(c.token_ids) for c in seen) == 30
            assert worker.engine.blocks.num_free == free

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_a_pull_lands_in_the_buffer_the_last_import_was_done_with(
        nats_url: str, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU a pull's buffer is a staging buffer: once its KV is in the pool, the next
    pull lands in the same memory (a fresh one pays its page faults; two were laid ready at
    the start, `Staging.warm`). A pull that failed keeps its buffer (UCX may still write
    it): the next pull gets another, the other one laid ready."""
    worker = tiny(DecodeService, "decode-s", nats_url, redis_url)
    landed: list[tuple[str, int]] = []  # request -> the address its KV landed at

    async def pull(_: object, request_id: str, token: str, sources: object, wanted: object,
                   buffer: torch.Tensor, skip: int) -> None:
        landed.append((request_id, buffer.data_ptr()))
        if token == "broken":
            raise TransferError("the prefill host went away")
        buffer.zero_()

    monkeypatch.setattr("services.decode.service.pull_pieces", pull)

    async def main() -> None:
        async with decode_serving(worker, nats_url, redis_url, "prefill-s",
                                  ["a", "b", "c", "d"]) as (nc, released, seen):
            for request_id, token in (("a", "t"), ("b", "t"), ("c", "broken"), ("d", "t")):
                await publish(nc, subjects.decode("decode-s"),
                              announcement(request_id, "prefill-s", token))
                await asyncio.wait_for(released.get(), 30)  # after its buffer's import
            await until(lambda: {c.request_id for c in seen if c.finish_reason} == {"a", "b", "d"})
            await until_idle(worker)
        where = dict(landed)
        assert where["b"] == where["a"] == where["c"]  # a's buffer, given back, twice
        assert where["d"] != where["c"]  # c's was not given back
        assert worker.staging.fresh == 0  # every pull's buffer was laid ready

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_a_decode_instance_pulls_only_the_blocks_after_the_prompts_start_it_holds(
        nats_url: str, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With prefix caching a decode instance keeps the blocks it imported and filled: a
    request whose prompt starts as an earlier one's (a conversation's next turn) takes the
    blocks it holds of that start and pulls only the rest; one of another cache_salt pulls
    all of its blocks, and so does one from a prefill instance that does not say it serves
    a pull's skip (one before it)."""
    settings = WorkerSettings(instance_id="decode-p", nats_url=nats_url, redis_url=redis_url,
                              model="tiny", heartbeat_s=0.1)
    worker = DecodeService(settings, Engine(EngineConfig(model="tiny", device="cpu")
                                            .with_scheduler(role=Role.DECODE,
                                                            prefix_caching=True)))
    pulled: dict[str, tuple[int, int]] = {}  # request -> blocks skipped, blocks pulled

    async def pull(_: object, request_id: str, token: str, sources: object, wanted: object,
                   buffer: torch.Tensor, skip: int) -> None:
        pulled[request_id] = (skip, buffer.shape[2])
        buffer.normal_()

    monkeypatch.setattr("services.decode.service.pull_pieces", pull)
    earlier = list(range(100, 140))  # 40 tokens: 2 full blocks and 8 tokens of a third
    turns = {"first": (earlier, ""), "next": ([*earlier, *range(7, 17)], ""),
             "salted": ([*earlier, *range(7, 17)], "tenant"),
             "older": ([*earlier, *range(7, 17)], "")}

    async def main() -> None:
        async with decode_serving(worker, nats_url, redis_url, "prefill-p",
                                  list(turns)) as (nc, released, seen):
            for request_id, (prompt, salt) in turns.items():
                ready = announcement(request_id, "prefill-p", "t").model_copy(update={
                    "prompt_ids": prompt, "computed": len(prompt),
                    "num_blocks": blocks_for(len(prompt), 16), "skips": request_id != "older",
                    "sampling": Sampling(max_tokens=16, ignore_eos=True, cache_salt=salt)})
                await publish(nc, subjects.decode("decode-p"), ready)
                await asyncio.wait_for(released.get(), 30)
                await until(lambda request_id=request_id: any(
                    c.request_id == request_id and c.finish_reason for c in seen))
            await until_idle(worker)

    asyncio.run(main())
    # the second shares the first's two full blocks (the third holds other tokens)
    assert pulled == {"first": (0, 3), "next": (2, 2), "salted": (0, 4), "older": (0, 4)}
    scheduler = worker.engine.scheduler
    assert scheduler.prefix_hits == 32 and scheduler.prefix_queried == 40 + 3 * 50
    assert not worker.prefixes  # each request's hashes let go once its blocks were taken
    assert worker.engine.blocks.num_free == worker.engine.blocks.num_blocks


def test_a_decode_instance_heartbeats_its_decode_steps_not_its_replays() -> None:
    """A failover's replay (prompt tokens beside the decodes) runs on a decode instance,
    which no plan prices as a prefill instance's step: its heartbeats leave it out, and a
    colocated worker's chunked steps stay in."""
    decode = tiny(DecodeService, "decode-h", "nats://unused", "redis://unused")
    colocated = tiny(ColocatedService, "colocated-h", "nats://unused", "redis://unused")
    for worker in (decode, colocated):
        worker.host.samples.extend([(1, StepShape((), 4, 400), 0.02, 1.0),
                                    (2, StepShape((3,), 4, 404, (60,)), 0.03, 1.1)])
    assert [s.step for s in decode.recent_steps()] == [1]
    assert [(s.step, s.prompts, s.done) for s in colocated.recent_steps()] == [
        (1, [], []), (2, [3], [60])]


def test_a_prefill_instance_exports_into_the_buffer_its_last_pull_was_sent_from() -> None:
    """The copy out of the pool lands in a staging buffer, which UCX's end of the send (the
    KV server's `sent`) gives back for the next export; one still being sent is not
    reused. Idle buffers hold a quarter of the pool's bytes at most: this 1 MiB pool's
    quarter holds none of a MiB."""
    engine = full_prefill_engine()
    worker = PrefillService(WorkerSettings(instance_id="prefill-x", model="tiny"), engine)
    assert worker.staging.max_idle_bytes == MIB // 4
    worker._sent(worker._export("parked-0", None))
    assert worker.staging.idle_bytes == 0
    worker.staging = Staging(max_idle_bytes=4 * MIB)
    first = worker._export("parked-0", None)
    assert np.array_equal(first, wire(engine.export_kv("parked-0")))
    worker._sent(first)
    second = worker._export("parked-1", None)
    assert second.ctypes.data == first.ctypes.data  # the same memory
    assert np.array_equal(second, wire(engine.export_kv("parked-1")))
    third = worker._export("parked-2", None)  # the second is being sent: another buffer
    assert third.ctypes.data != second.ctypes.data and worker.staging.fresh == 2
    assert np.array_equal(third, wire(engine.export_kv("parked-2")))


@pytest.mark.timeout(120)
def test_a_failed_pull_frees_its_blocks_releases_the_kv_and_asks_to_be_moved(
        nats_url: str, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill instance answers the pull with an error: the blocks taken for it are
    freed, the KV released (the prefill instance may still hold it), and the gateway asked
    to move the request (a retry chunk), which never decodes here."""
    worker = tiny(DecodeService, "decode-f", nats_url, redis_url)

    async def pull(client: object, request_id: str, *rest: object) -> None:
        raise TransferError(f"no KV for {request_id}")

    monkeypatch.setattr("services.decode.service.pull_pieces", pull)

    async def main() -> None:
        async with decode_serving(worker, nats_url, redis_url, "prefill-f",
                                  ["lost"]) as (nc, released, seen):
            free = worker.engine.blocks.num_free
            await publish(nc, subjects.decode("decode-f"), announcement("lost", "prefill-f", "t"))
            release = await asyncio.wait_for(released.get(), 30)
            assert (release.request_id, release.attempt) == ("lost", 0)
            await until(lambda: bool(seen))
            (chunk,) = seen
            assert chunk.retry and chunk.error is not None and \
                chunk.error.startswith("KV transfer failed: no KV for lost")
            assert chunk.token_ids == [] and chunk.attempt == 0
            await until_idle(worker)
            assert not worker.pulling and "lost" not in worker.attempts
            assert worker.engine.blocks.num_free == free

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_kv_held_in_another_dtype_is_refused_before_any_byte_moves(
        nats_url: str, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill instance whose KV pool is of another dtype (bfloat16 on a GPU, beside a
    float16 decode instance): its bytes would read as garbage here, so the pull is never
    made; the blocks are freed, the KV released and the gateway asked to move the request,
    with the reason. KV in this instance's dtype (or a sender that does not say) is pulled."""
    worker = tiny(DecodeService, "decode-d", nats_url, redis_url)
    pulled: list[str] = []

    async def pull(client: object, request_id: str, *rest: object) -> None:
        pulled.append(request_id)
        raise TransferError(f"no KV for {request_id}")

    monkeypatch.setattr("services.decode.service.pull_pieces", pull)

    async def main() -> None:
        async with decode_serving(worker, nats_url, redis_url, "prefill-d",
                                  ["odd", "same", "unsaid"]) as (nc, released, seen):
            free = worker.engine.blocks.num_free
            assert worker.engine.runner.kv_dtype_name == "float32"
            for request_id, dtype, why in (
                    ("odd", "bfloat16", "prefill holds the KV in bfloat16, this instance in "
                                        "float32"),
                    ("same", "float32", "no KV for same"), ("unsaid", "", "no KV for unsaid")):
                ready = announcement(request_id, "prefill-d", "t").model_copy(
                    update={"kv_dtype": dtype})
                await publish(nc, subjects.decode("decode-d"), ready)
                release = await asyncio.wait_for(released.get(), 30)
                assert release.request_id == request_id
                await until(lambda: len(seen) == 1)
                chunk = seen.pop()
                assert chunk.retry and (chunk.error or "").startswith(
                    f"KV transfer failed: {why}")
            await until_idle(worker)
            assert pulled == ["same", "unsaid"]
            assert worker.engine.blocks.num_free == free

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_a_pull_cancelled_before_its_task_ran_frees_its_blocks_and_releases_the_kv(
        nats_url: str, redis_url: str) -> None:
    """A newer attempt or a cancel can reach a pull in the same turn of the loop that
    started it: a task cancelled before its first step runs none of its body (its
    `finally` included), so the blocks taken for it were lost and the KV never released
    until a callback on the task did both."""
    worker = tiny(DecodeService, "decode-c", nats_url, redis_url)

    async def main() -> None:
        async with decode_serving(worker, nats_url, redis_url, "prefill-c",
                                  []) as (_, released, _):
            free = worker.engine.blocks.num_free
            ready = announcement("early", "prefill-c", "t")
            (grant,) = await worker.host.call(worker._allocate_in_order, [ready])
            assert worker.engine.blocks.num_free == free - 1
            pull = worker._start_pull(ready, grant)
            pull.cancel()  # before it ever ran
            await asyncio.gather(pull, return_exceptions=True)
            assert pull.cancelled() and not grant.started  # none of its body ran
            release = await asyncio.wait_for(released.get(), 30)
            assert (release.request_id, release.attempt) == ("early", 0)
            await until_idle(worker)
            assert not worker.pulling and worker.engine.blocks.num_free == free

    asyncio.run(main())


def spin(seconds: float) -> None:
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        pass


def test_thread_clock_splits_cpu_time_from_waiting_for_a_cpu() -> None:
    """A thread sharing its one CPU with a spinning process is on it about half the time and
    waits runnable for the rest: the split the engine-loop counters report per step."""
    cpu = sorted(os.sched_getaffinity(0))[0]
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    neighbour = multiprocessing.get_context("fork").Process(target=spin, args=(5.0,))
    try:
        neighbour.start()
        time.sleep(0.2)  # the neighbour spinning
        cpu_0, queued_0 = thread_clock()
        started = time.monotonic()
        spin(1.0)
        wall = time.monotonic() - started
        cpu_s, queued_s = thread_clock()[0] - cpu_0, thread_clock()[1] - queued_0
    finally:
        neighbour.kill()
        neighbour.join()
        os.sched_setaffinity(0, mine)
    assert 0.05 < cpu_s < 0.9 * wall  # it shared the CPU
    assert queued_s > 0.1 * wall  # and waited for it, runnable
    assert cpu_s + queued_s == pytest.approx(wall, rel=0.15)



def full_prefill_engine() -> Engine:
    """A prefill engine (128 blocks of 16) whose pool four parked requests fill but for 4
    blocks, and a prompt of 6 blocks waiting: it cannot run until one is freed."""
    engine = Engine(EngineConfig(model="tiny", device="cpu", kv_cache_bytes=1 << 20)
                    .with_scheduler(role=Role.PREFILL))
    assert engine.blocks.num_blocks == 128
    for i in range(4):
        engine.add_request(f"parked-{i}", list(range(1, 31 * 16 - 3)),  # 31 blocks each
                           SamplingParams(max_tokens=4))
        (out,) = engine.step()
        assert out.parked
    engine.add_request("waiting", list(range(1, 6 * 16 + 1)), SamplingParams(max_tokens=4))
    assert engine.step() == [] and engine.stalled
    return engine


def run_stalled(engine: Engine, frees: bool, poll_s: float = 0.25) -> tuple[int, float]:
    """The host stepping `engine`, stalled: with `frees`, its on_stalled frees a parked
    request; else, after a second, a parked request is freed through the host (which wakes
    it). How many steps it tried in that second, and how long the waiting prompt took from
    then."""
    host, tries, outputs = EngineHost(engine), [0], []
    step = engine.step

    def counted() -> list[RequestOutput]:
        tries[0] += 1
        return step()

    engine.step = counted  # type: ignore[method-assign]

    async def on_outputs(got: list[RequestOutput]) -> None:
        outputs.extend(got)

    async def on_stalled() -> bool:
        return frees and engine.release("parked-0")

    async def main() -> tuple[int, float]:
        loop = asyncio.create_task(host.run(on_outputs, on_stalled, stalled_poll_s=poll_s))
        if not frees:
            await asyncio.sleep(1.0)
            await host.call(engine.release, "parked-0")  # an engine call wakes the loop
        stalled, started = tries[0], time.monotonic()
        while not any(o.request_id == "waiting" for o in outputs):
            await asyncio.sleep(0.005)
        loop.cancel()
        return stalled, time.monotonic() - started

    return asyncio.run(main())


def test_a_stalled_engine_is_tried_again_when_woken_not_in_a_loop() -> None:
    """Its waiting prompt does not fit the pool: the host tries again when woken (blocks
    freed) or every `stalled_poll_s`, not a thousand times a second as it did (a core
    spent); an `on_stalled` that frees blocks lets the prompt in at once."""
    engine = full_prefill_engine()
    stalled, taken = run_stalled(engine, frees=False)
    assert 1 <= stalled <= 1.0 / 0.25 + 2  # before: thousands of empty steps in the second
    assert taken < 0.25  # woken, not polled
    assert "parked-0" not in engine.scheduler.parked and "waiting" in engine.scheduler.parked
    engine = full_prefill_engine()
    _, taken = run_stalled(engine, frees=True)
    assert taken < 0.25 and "waiting" in engine.scheduler.parked
    assert "parked-0" not in engine.scheduler.parked


def test_a_full_prefill_instance_frees_the_kv_it_retained_longest() -> None:
    """KV its decode instance has imported is retained only to resume faster after a
    failure: when a waiting prompt does not fit, it goes, oldest first; KV not yet pulled
    never does."""
    engine = full_prefill_engine()
    worker = PrefillService(WorkerSettings(instance_id="prefill-r", model="tiny"), engine)
    worker.released_at = {"parked-2": 20.0, "parked-1": 10.0}

    async def main() -> None:
        assert await worker.on_stalled()
        assert set(engine.scheduler.parked) == {"parked-0", "parked-2", "parked-3"}
        assert await worker.on_stalled()
        assert not await worker.on_stalled()  # none retained: wait for room
        assert set(engine.scheduler.parked) == {"parked-0", "parked-3"}

    asyncio.run(main())


def test_a_colocated_worker_traces_the_copy_it_serves_and_keeps_nothing_after(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The spans of a colocated worker's request come from the engine copy of its newest
    attempt (an older copy's outputs, while a newer attempt waits to be taken in, are not
    its); a step that began a request cancelled meanwhile leaves nothing behind."""
    from services.colocated import service as colocated

    spans: list[tuple[str, float, float]] = []
    monkeypatch.setattr(colocated, "record", lambda _tracer, name, _parent, start, end,
                        **_: spans.append((name, start, end)))
    worker = tiny(ColocatedService, "colocated-r", "nats://unused", "redis://unused")
    worker.subscriptions()
    assert worker.host.on_began == worker._began
    # a cancel read while the step that began the request ran: the step's news comes after
    worker.arrived["gone"], worker.copies["gone"] = (10.0, {}, 3), 1
    worker._untrace("gone")
    worker.host.on_began([("gone", 1)], 10.5)
    # a newer attempt waiting to be taken in: the older copy's first token is not its
    worker.arrived["r"], worker.copies["r"] = (20.0, {}, 3), colocated.PENDING
    worker._trace(RequestOutput("r", [5], "x", arrival=1), 20.2)
    assert "r" in worker.arrived and not spans
    worker.copies["r"] = 2  # taken in
    worker.host.on_began([("r", 1), ("r", 2)], 20.3)
    worker._trace(RequestOutput("r", [6], "y", arrival=2), 20.6)
    worker._trace(RequestOutput("r", [7], "z", finish_reason="length", arrival=2), 20.9)
    assert spans == [("prefill queue", 20.0, 20.3), ("prefill run", 20.3, 20.6),
                     ("decode run", 20.6, 20.9)]
    assert not (worker.arrived or worker.began or worker.copies or worker.decoding)
