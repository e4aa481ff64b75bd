"""What every worker process shares beyond services/process.py: the engine host
(services/engine_host.py) and heartbeats (services/heartbeats.py) put together, admission
and cancels (the gateways' and those of gateways gone), draining and shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Literal

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from redis.asyncio import Redis
from redis.exceptions import RedisError

from services import liveness
from services.cancelled import Cancelled
from services.engine_host import EngineHost
from services.heartbeats import Heartbeats
from services.leases import GatewayLeases, read_leases
from services.liveness import HUNG, mark_leaving, step_timeout_problem, turning
from services.process import WorkerSettings, built_or_exit, run_until_signalled, setup_logging
from services.supervisor import DRAINED
from shared import subjects
from shared.aio import cancel_within
from shared.bus import connect, parse, publish
from shared.engine.config import Role
from shared.engine.engine import Engine, RequestOutput, RequestRejected
from shared.engine.model_runner import dtype_name
from shared.engine.parallel.group import collective_timeout
from shared.engine.request import Draw, Request
from shared.host import machine_id
from shared.messages import Cancel, PrefillRequest, TokenChunk
from shared.state import InstanceInfo, Registry, StepSample, redis_client
from shared.telemetry import setup_tracing
from shared.telemetry import shutdown as shutdown_tracing

log = logging.getLogger(__name__)

SCORES_PER_CHUNK = 1024  # prompt positions whose scores one chunk carries (~200 KB at top 5)


def prompt_part(scores: list[Draw], start: int) -> dict[str, Any]:
    """The TokenChunk fields of the prompt's scores from position `start` on (a part)."""
    part = scores[start:start + SCORES_PER_CHUNK]
    return {"prompt_from": start, "prompt_logprobs": [d.logprob or 0.0 for d in part],
            "prompt_top_logprobs": [list(d.top) for d in part]}


def serve(role: str, build: Callable[[], Worker]) -> None:
    """A worker process's life: build it (a message and code 2 where it cannot start), run it
    until a signal or a Drain message, and exit 0, or DRAINED where it was asked to leave."""
    setup_logging(role)
    worker = built_or_exit(role, build)
    asyncio.run(run_until_signalled(worker.run))
    sys.exit(DRAINED if worker.asked_to_leave else 0)


class WorkerFailed(RuntimeError):
    """One of the worker's tasks (engine loop, heartbeat, pulls) ended with an error."""


class Worker:
    """The shell every engine service shares: settings, engine host, NATS subscriptions,
    heartbeats, tracing, and an orderly stop. A service adds its subscriptions, background
    tasks and what it does with each step's outputs."""

    role: Literal["prefill", "decode", "colocated"]
    engine_role: Role

    def __init__(self, settings: WorkerSettings, engine: Engine | None = None) -> None:
        self.settings = settings.named(self.role)
        self.id = self.settings.instance_id
        self.engine = engine or Engine(self.settings.engine_config(self.engine_role))
        self.host = EngineHost(self.engine)
        self.tracer = setup_tracing(self.id, self.settings.run_dir)
        self.draining = False
        self.asked_to_leave = False  # a Drain message came: exit DRAINED, not to be restarted
        self.ticks = 0  # turns of the event loop (`_tick`)
        self.attempts: dict[str, int] = {}  # request -> the gateway's attempt served here
        self.cancelled = Cancelled()  # a cancel may overtake its request: never start those
        # request -> the gateway it came from (PrefillRequest.gateway), set as it arrives;
        # the requests no longer held are dropped each time the gateways' leases are read
        self.gateways: dict[str, str] = {}
        self.in_hand: set[asyncio.Task[Any]] = set()  # admissions and aborts under way (detach)
        self.nc: Client

    def info(self) -> InstanceInfo:
        blocks, scheduler = self.engine.blocks, self.engine.scheduler
        capacity = min(self.engine.model_config.max_context, blocks.num_blocks * blocks.block_size)
        return InstanceInfo(instance_id=self.id, role=self.role,
                            queue_len=len(scheduler.waiting), running=len(scheduler.running),
                            free_blocks=blocks.num_free, total_blocks=blocks.num_blocks,
                            cached_blocks=blocks.num_cached,
                            prefix_queried=scheduler.prefix_queried,
                            prefix_hits=scheduler.prefix_hits,
                            draining=self.draining, max_request_tokens=capacity,
                            chunked=self.role == "colocated" and scheduler.config.chunked_prefill,
                            weights=self.engine.config.weights,
                            dtype=dtype_name(self.engine.runner.dtype),
                            tp=self.engine.config.tp,
                            pp=self.engine.config.pp, machine=machine_id(),
                            busy_since=self.host.busy_since,
                            stuck_since=self.host.stuck_since(),
                            stuck_on_prompts=self.engine.prompts_under_way,
                            max_running=scheduler.config.max_running, steps=self.host.steps,
                            stalled_steps=self.host.stalled_steps,
                            step_seconds=self.host.step_s, step_cpu_seconds=self.host.step_cpu_s,
                            step_queued_seconds=self.host.step_queued_s,
                            outputs_seconds=self.host.outputs_s,
                            batched=self.host.batched, recent_steps=self.recent_steps(),
                            held=self.held())

    def held(self) -> dict[str, int]:
        """Each request held here, with its attempt (from the heartbeat's thread: copies
        made in one C call each, which no other thread interleaves)."""
        return dict(self.attempts)

    def recent_steps(self) -> list[StepSample]:
        """The engine's last steps, for the heartbeat (its thread, not the loop's); not a
        decode instance's failover replays (prompt tokens beside its decodes), which no plan
        prices: a calibration would take them for a prefill instance's steps."""
        return [StepSample(step=step, prompts=list(shape.prompts), batch=shape.batch,
                           context=shape.context, done=list(shape.done), seconds=seconds,
                           ended=ended)
                for step, shape, seconds, ended in self.host.samples.copy()
                if not (shape.prompts and self.role == "decode")]

    def holding(self) -> int:
        """Requests the service holds outside the engine (decode: announced, not pulled)."""
        return 0

    def holds(self, request_id: str) -> bool:
        """Whether the request is here in any form: queued, being taken in or pulled,
        running, or its KV parked (`held`)."""
        return request_id in self.held()

    def idle(self) -> bool:
        """Nothing queued, running, parked or being pulled: every KV block is free."""
        blocks = self.engine.blocks
        return not self.engine.has_work() and blocks.num_free == blocks.num_blocks and \
            not self.holding() and not self.in_hand

    def subscriptions(self) -> dict[str, Callable[[Msg], Awaitable[None]]]:
        return {}

    def background(self) -> list[Coroutine[Any, Any, None]]:
        return []

    async def on_outputs(self, outputs: list[RequestOutput]) -> None:
        raise NotImplementedError

    async def on_stalled(self) -> bool:
        """The engine's last step ran nothing (what waits does not fit the pool): free
        something it may run in (True), or wait for room to come (False)."""
        return False

    async def closing(self) -> None:
        """Release what the service holds besides the engine (listeners, endpoints)."""

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` (a signal) or a drain message, then drain and exit; a task that
        fails ends the worker at once with WorkerFailed."""
        self.nc = await connect(self.settings.nats_url, self.id)
        redis = redis_client(self.settings.redis_url)
        registry = Registry(redis, self.settings.heartbeat_ttl_s)

        async def on_drain(_: Msg) -> None:
            self.asked_to_leave = True
            mark_leaving(self.settings.alive_file)
            stop.set()

        for subject, callback in (self.subscriptions() | {subjects.drain(self.id): on_drain}
                                  ).items():
            await self.nc.subscribe(subject, cb=callback)
        heartbeats = Heartbeats(self.settings, self.info, self._turning(),
                                self.host.stuck_since,
                                lambda: DRAINED if self.asked_to_leave else HUNG,
                                lambda: self.ticks)
        heartbeats.start()
        # the loop's turns counted until the alive file is gone (after the tasks and the
        # requests in hand are cancelled): a worker stopping in order never goes silent
        ticking = asyncio.create_task(self._tick(), name="ticks")
        named = {"engine loop": self.host.run(self.on_outputs, self.on_stalled)}
        named |= {f"background {i}": c for i, c in enumerate(self.background())}
        named["gateway leases"] = self._cancel_orphans(redis)
        tasks = [asyncio.create_task(c, name=n) for n, c in named.items()]
        config = self.engine.config
        runner = self.engine.runner
        problem = config.ranks > 1 and step_timeout_problem(
            self.settings.step_timeout_s, collective_timeout().total_seconds(), config.ranks)
        if problem:
            log.warning("%s: %s", self.id, problem)
        log.info("%s %s ready (%s weights, %s, KV in %s%s)", self.role, self.id, config.weights,
                 dtype_name(runner.dtype), runner.kv_dtype_name,
                 f", tp {config.tp} pp {config.pp}" if config.ranks > 1 else "")
        ending = asyncio.create_task(self._drain_after(stop, registry, redis), name="drain")
        try:
            done, _ = await asyncio.wait([ending, *tasks], return_when=asyncio.FIRST_COMPLETED)
            # ended before Redis closes (a Redis loop that lost its cancel would run on:
            # shared.aio); then the requests in hand, with those taken in meanwhile
            await cancel_within([ending, *tasks], who=self.id)
            await cancel_within(list(self.in_hand), who=self.id)
        except asyncio.CancelledError:  # run inside a larger program (a test) that ends it:
            heartbeats.halt()  # its watchdog must not end that program later
            ticking.cancel()
            raise
        failed = next((t for t in done if t is not ending), None)
        await asyncio.to_thread(heartbeats.stop)
        await cancel_within([ticking], who=self.id)
        with contextlib.suppress(RedisError, OSError):  # it expires by itself otherwise
            await registry.remove(self.id, self.role)
        await self.closing()
        # after the step in progress (its ranks stop), but not for ever behind a wedged one:
        # its alive file is gone (stopping in order), so nothing would kill it
        wedged = False
        try:
            async with asyncio.timeout(self.settings.step_timeout_s or None):
                await self.host.call(self.engine.close)
        except TimeoutError:
            log.error("%s: the engine did not close within %.0f s (a step wedged): exiting "
                      "without it", self.id, self.settings.step_timeout_s)
            wedged = True
        shutdown_tracing()
        await self.nc.drain()
        await redis.aclose()
        if wedged:  # an orderly exit joins the engine thread, which never returns
            liveness.exit_now(DRAINED if self.asked_to_leave else HUNG)
        if failed is not None:
            # a worker whose engine loop died must not linger: leave dispatch and exit, so
            # the gateway fails the requests it held instead of waiting for them
            raise WorkerFailed(f"{self.id}: {failed.get_name()} stopped") from failed.exception()

    async def _tick(self, every_s: float = 0.5) -> None:
        """Count this loop's turns: the heartbeat thread shows the worker alive only while
        they go on (a loop held by a call that never returns, while the heartbeats beat on
        their own thread, is a hung worker too)."""
        while True:
            self.ticks += 1
            await asyncio.sleep(every_s)

    def _turning(self) -> Callable[[], bool]:
        """Whether this loop has ticked since the last call, and its engine (a step, or a
        call on its thread) has not been at one thing past `step_timeout_s`
        (`liveness.turning`; from any thread)."""
        return turning(lambda: self.ticks, self.host.stuck_since,
                       self.settings.step_timeout_s, self.id)

    async def _drain_after(self, stop: asyncio.Event, registry: Registry, redis: Redis) -> None:
        """Leave dispatch, then wait until the instance holds nothing and no gateway has a
        request in flight to it (dispatch runs on heartbeats up to a TTL old, so a request
        may still arrive just after the flag is set)."""
        await stop.wait()
        self.draining = True
        with contextlib.suppress(nats.errors.Error, OSError):
            await publish(self.nc, subjects.HEARTBEATS, self.info())
        with contextlib.suppress(RedisError, OSError):
            await registry.heartbeat(self.info())
        log.info("%s draining", self.id)
        started = time.monotonic()
        while True:
            waited = time.monotonic() - started
            inflight = await self._inflight(redis)
            if waited >= self.settings.heartbeat_ttl_s and inflight <= 0 and self.idle():
                log.info("%s drained in %.1fs", self.id, waited)
                return
            if waited > self.settings.drain_timeout_s:
                log.warning("%s: drain timed out after %.0fs with %d requests in flight; "
                            "exiting", self.id, waited, inflight)
                return
            await asyncio.sleep(0.1)

    async def _inflight(self, redis: Redis) -> int:
        """Requests the live gateways say they have in flight here (each gateway's count
        expires with it); a Redis that fails counts as none, so a drain still ends."""
        try:
            keys = [k async for k in redis.scan_iter(match=subjects.inflight_keys(self.id))]
            counts = await redis.mget(keys) if keys else []
        except (RedisError, OSError):
            return 0
        return sum(int(c) for c in counts if c is not None)

    def take_in(self, admission: Coroutine[Any, Any, None]) -> None:
        """Run a request's admission (`admit` and what follows it) in a task of its own
        (`detach`): an admission waits for the engine step under way, so awaited in the
        callback it let one request into the engine a step (a prefill instance then
        prefilled one prompt a step however many were waiting). Tasks start in the order
        they were made and each hands its engine call to the engine thread before it first
        yields, so requests still reach the engine in arrival order: all that arrived during
        a step, before the next."""
        self.detach(admission, "an admission")

    def abort(self, request_id: str) -> None:
        """Drop a request from the engine: the abort is queued on the engine thread at once
        (before any call that follows, a newer attempt's admission among them) and waited
        for in a task of its own (`detach`). Awaited in the cancel callback, it held back
        every later cancel for a step, so a burst of cancels was read one a step while the
        engine ran the requests they named (a cancel that overtook its request's admission
        then came too late: its tokens streamed). Whatever the service keeps of the request
        is dropped in the callback; the engine drops its copy after the step under way."""
        self.detach(self._abort(self.host.submit(self.engine.abort, request_id)), "an abort")

    async def _abort(self, abort: asyncio.Future[bool]) -> None:
        if await abort:
            self.aborted()

    def aborted(self) -> None:
        """A request the engine held is gone: its blocks are free (a role waiting for room
        hears it here)."""

    def detach(self, work: Coroutine[Any, Any, Any], what: str) -> None:
        """Run `work` in a task of its own, so that a subscription's callback returns at
        once: nats-py hands a subscription's messages to its callback one at a time, and a
        callback that awaits the engine thread holds back every message after it for a
        step. The task counts against `idle` until it ends, and is cancelled when the
        worker stops; a failure is logged."""
        task = asyncio.create_task(work)
        self.in_hand.add(task)
        task.add_done_callback(functools.partial(self._handed, what))

    def _handed(self, what: str, task: asyncio.Task[Any]) -> None:
        self.in_hand.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s: %s failed", self.id, what, exc_info=task.exception())

    async def admit(self, req: PrefillRequest) -> Request | None:
        """Queue a prompt (with the tokens a failed-over request already streamed) on the
        engine; a request it can never run gets an error chunk (and None), and one cancelled
        before or while it was taken in, nothing (and None)."""
        if self.cancelled.covers(req.request_id, req.attempt):
            log.info("%s: %s was cancelled before it arrived", self.id, req.request_id)
            return None
        try:  # its outputs carry its attempt (`stream`)
            params = req.sampling.params()
            await asyncio.to_thread(self.engine.prepare, params)  # a grammar: off the steps
            request = await self.host.call(self.engine.add_request, req.request_id,
                                           req.prompt_ids, params, req.output_ids, req.attempt)
        except (RequestRejected, ValueError) as e:
            await self.send(TokenChunk(request_id=req.request_id, error=str(e), source=self.id,
                                       seq=len(req.output_ids), attempt=req.attempt,
                                       refused=isinstance(e, RequestRejected)))
            return None
        if self.cancelled.covers(req.request_id, req.attempt):  # read while taken in
            # this copy only: a newer attempt taken in since (after the cancel) stays
            await self.host.call(self.engine.abort, req.request_id, request)
            return None
        self.attempts[req.request_id] = req.attempt
        return request

    async def _on_cancel(self, msg: Msg) -> None:
        self.cancel(parse(msg, Cancel))

    def cancel(self, cancel: Cancel) -> None:
        """Drop each copy of the request the cancel covers here (`cancel_for_me`): a
        gateway's, or one for a request whose gateway is gone (`_cancel_orphans`)."""
        raise NotImplementedError

    async def _cancel_orphans(self, redis: Redis) -> None:
        """Every ~2 s, read the leases of the gateways whose requests are held here, and
        cancel the requests of each gateway gone (GatewayLeases) as its clients' cancels
        would: killed, it cancels nothing, and they ran to max_tokens with nobody listening,
        their KV taken from new traffic."""
        leases = GatewayLeases(self.settings.gateway_lease_s)
        while True:
            await asyncio.sleep(min(2.0, self.settings.gateway_lease_s / 2))
            held = self.held()
            self.gateways = {r: g for r, g in self.gateways.items() if r in held}
            present = await read_leases(redis, set(self.gateways.values()) - {""}, self.id)
            for gateway, absent_s in leases.observe(present, time.monotonic()).items():
                held = self.held()  # as they are after the read
                orphans = [r for r, g in self.gateways.items() if g == gateway and r in held]
                for request_id in orphans:
                    self.cancel(Cancel(request_id=request_id))
                if orphans:  # else they all ended during the read
                    log.warning("%s: gateway %s is gone (no heartbeat for %.0f s): cancelled "
                                "%d requests", self.id, gateway, absent_s, len(orphans))

    def cancel_for_me(self, cancel: Cancel) -> str | None:
        """The id of the request a cancel drops here (it names every instance, or this one),
        remembered: for every attempt when it names every instance (the client went away:
        nothing of it may start later), for the attempts up to the one it names when it
        names this instance (the request moved away; a later attempt may come back). None
        if the cancel is for another instance."""
        if cancel.instance not in ("", self.id):
            return None
        if not cancel.instance:
            self.cancelled.add(cancel.request_id)
        elif cancel.attempt is not None:
            self.cancelled.add(cancel.request_id, cancel.attempt)
        return cancel.request_id

    async def stream(self, out: RequestOutput) -> None:
        """New tokens and text, the end, or the error that failed the request's step, as the
        attempt of the copy that produced them (its tag: labelled by request id, an older
        copy's output from the step under way as a newer attempt was taken in here went out
        as the newer attempt, at the older copy's index: a gap to the gateway)."""
        attempt = out.tag
        if out.finished:
            if self.attempts.get(out.request_id) == attempt:  # not a newer attempt's
                del self.attempts[out.request_id]
            # a copy of this attempt coming late (its acknowledgement was lost) must not run
            self.cancelled.add(out.request_id, attempt)  # it again
        # a long prompt's scores in parts (each well under NATS's 1 MiB message), all but the
        # last ahead of the token: chunks of one subject arrive in order
        scores = out.prompt_logprobs
        parts = [prompt_part(scores, start)
                 for start in range(0, len(scores), SCORES_PER_CHUNK)] or [{}]
        for part in parts[:-1]:
            await self.send(TokenChunk(request_id=out.request_id, seq=out.index,
                                       attempt=attempt, source=self.id, **part))
        await self.send(TokenChunk(request_id=out.request_id, seq=out.index, attempt=attempt,
                                   token_ids=out.new_token_ids, text=out.new_text,
                                   logprobs=out.logprobs,
                                   top_logprobs=[list(top) for top in out.top_logprobs],
                                   finish_reason=out.finish_reason,
                                   error=out.error, refused=out.refused, source=self.id,
                                   cached_tokens=out.cached_tokens, **parts[-1]))

    async def send(self, chunk: TokenChunk) -> None:
        """Publish a chunk; a failure (NATS down, its buffer full) is logged, never raised:
        the engine loop goes on, and the gateway sees the gap by the chunk's seq. A chunk
        past NATS's message limit fails its request clearly instead (sent again, it would
        be as large)."""
        try:
            await publish(self.nc, subjects.tokens(chunk.request_id), chunk)
        except nats.errors.MaxPayloadError as e:
            log.warning("%s: a chunk of %s is too large to send: %s", self.id,
                        chunk.request_id, e)
            with contextlib.suppress(nats.errors.Error, OSError):
                await publish(self.nc, subjects.tokens(chunk.request_id), TokenChunk(
                    request_id=chunk.request_id, seq=chunk.seq, attempt=chunk.attempt,
                    error=f"an answer's chunk is past the message limit ({e})",
                    source=self.id))
        except (nats.errors.Error, OSError) as e:
            log.warning("%s: lost a chunk of %s: %s", self.id, chunk.request_id, e)
