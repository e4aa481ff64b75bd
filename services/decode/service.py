"""A decode instance: its own engine (decode role). Announced requests wait in `pending`
until the pool has room (on the CPU their blocks are taken at once, beside the step under
way); then the KV is pulled over UCX straight into a buffer that is imported at this pool's
block ids, the prefill instance is told it may free its copy (after a short retention), and
the request joins the running batch. With prefix caching the blocks of the prompt's start
that this pool holds already (a conversation's earlier turns, a shared system prompt) are
taken as they are and only the blocks after them are pulled. Pulls run several at a time,
each bounded by a timeout: a request whose pull fails gets a `retry` chunk, and the gateway
moves it elsewhere."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import nats.errors
import torch
from nats.aio.msg import Msg
from pydantic import ValidationError
from redis.exceptions import RedisError

from services.process import WorkerSettings
from services.runtime import Worker
from shared import subjects
from shared.bus import acknowledge, parse
from shared.engine.block_manager import BlockHash
from shared.engine.config import Role
from shared.engine.engine import Engine, RequestOutput, RequestRejected
from shared.engine.kv_cache import Staging, block_bytes
from shared.engine.parallel.kv_serving import KvPull
from shared.engine.parallel.layout import KvSpan
from shared.engine.request import Request
from shared.kv_transfer import KvClient, TransferError, pull_pieces, stop_notifier_thread
from shared.messages import (
    Cancel,
    KvReady,
    KvWanted,
    KvWantedReply,
    ReleaseKv,
    TokenChunk,
)
from shared.state import InstanceInfo, Registry, redis_client
from shared.telemetry import context_from, record

log = logging.getLogger(__name__)
T = TypeVar("T")
MOST_PREFIXES = 1024  # queued requests whose block hashes are kept between tries


@dataclass
class Grant:
    """Blocks taken for a request's KV, the buffer rank 0's part arrives in, and the other
    ranks' pulls of theirs (None: one rank). The first `held` blocks hold their KV already
    (prefix caching: cached here for an earlier request), so only the rest is pulled."""

    blocks: list[int]
    buffer: torch.Tensor
    held: int = 0
    ranks: concurrent.futures.Future[bool] | None = None
    importing: asyncio.Future[None] | None = None  # rank 0's part into its blocks
    started: bool = False  # its pull task ran: a task cancelled before never runs its body


def _sources(ready: KvReady) -> list[tuple[str, KvSpan]]:
    """The prefill instance's listeners and the part of the KV each holds."""
    return [(s.address, s.span()) for s in ready.sources]


def _mismatch(ready: KvReady, blocks: list[int], kv_dtype: str) -> str | None:
    """Why the announced KV cannot land in `blocks` of a pool of `kv_dtype`, or None."""
    if ready.num_blocks != len(blocks):
        return f"prefill sent {ready.num_blocks} blocks, expected {len(blocks)}: block sizes differ"
    if ready.kv_dtype not in ("", kv_dtype):
        return (f"prefill holds the KV in {ready.kv_dtype}, this instance in {kv_dtype}: the "
                "KV cannot move between them")
    return None


class DecodeService(Worker):
    role = "decode"
    engine_role = Role.DECODE

    def __init__(self, settings: WorkerSettings, engine: Engine | None = None) -> None:
        super().__init__(settings, engine)
        self.kv_client = KvClient(timeout_s=self.settings.kv_pull_timeout_s)
        self.pending: deque[KvReady] = deque()
        self.pulling: dict[str, tuple[int, asyncio.Task[None]]] = {}  # request -> attempt, pull
        # ReleaseKv not yet acknowledged: its task -> the request
        self.releasing: dict[asyncio.Task[None], str] = {}
        self.room = asyncio.Event()  # set when something may have become pullable
        self.traces: dict[str, tuple[dict[str, str], float]] = {}  # trace headers, since
        self.freeing: set[asyncio.Task[None]] = set()  # blocks of pulls cancelled early
        self.connecting: dict[str, asyncio.Task[None]] = {}  # listener -> opening ahead
        # the buffers pulls land in on the CPU, reused once imported (not one whose pull
        # failed: its endpoint was aborted, which cancels the receive, and still it is not
        # lent again). Rank 0's part only: each other rank stages its own (kv_serving.RankKv)
        self.staging = Staging.for_pool(self.engine.runner.kv,
                                        self.settings.max_batch_tokens)
        self.block_bytes = block_bytes(self.engine.model_config, self.engine.blocks.block_size,
                                       self.engine.runner.kv.data.dtype)  # every rank's part
        # queued requests' block hashes (`_prefix`), by request and attempt
        self.prefixes: OrderedDict[tuple[str, int], list[BlockHash]] = OrderedDict()

    def info(self) -> InstanceInfo:
        stats = self.kv_client.stats
        requests, nbytes = self.engine.kv_moved_on_ranks()  # the pulls the others made
        return super().info().model_copy(update={
            "queue_len": len(self.pending), "kv_requests": stats.requests + requests,
            "preempted": len(self.engine.scheduler.waiting),
            "kv_bytes": stats.bytes + nbytes})

    def holding(self) -> int:
        return len(self.pending) + len(self.pulling) + len(self.freeing)

    def subscriptions(self) -> dict[str, Callable[[Msg], Awaitable[None]]]:
        return {subjects.decode(self.id): self._on_kv_ready, subjects.CANCEL_ALL: self._on_cancel,
                subjects.wanted(self.id): self._on_wanted}

    def background(self) -> list[Coroutine[Any, Any, None]]:
        return [self._pull_forever(), self._connect_ahead()]

    async def _connect_ahead(self, every_s: float = 1.0, gone_s: float = 10.0) -> None:
        """Open an endpoint to each prefill instance's KV listener once the registry lists it
        (and again after its peer closed it), so that no pull waits for the connection: a
        request's first pull from an instance did, 168 ms of 205 (Zen 4, 23.6 MB). The
        endpoint to a listener the registry has not listed for `gone_s` is closed (a prefill
        instance stopped, or came back on another port)."""
        redis = redis_client(self.settings.redis_url)
        registry = Registry(redis, self.settings.heartbeat_ttl_s)
        listed_at: dict[str, float] = {}  # listener -> when the registry last listed it
        try:
            while True:
                with contextlib.suppress(RedisError, OSError, ValidationError):
                    self._connect_listed(await registry.instances("prefill"), listed_at, gone_s)
                await asyncio.sleep(every_s)
        finally:
            for task in list(self.connecting.values()):
                task.cancel()
            await asyncio.shield(redis.aclose())  # the stop cancels again (shared.aio)

    def _connect_listed(self, prefills: list[InstanceInfo], listed_at: dict[str, float],
                        gone_s: float) -> None:
        """Start opening an endpoint to each listed listener not connected (each in a task of
        its own: UCX gives up on a listener that is gone only at the timeout); drop those
        not listed for `gone_s`."""
        now = time.monotonic()
        for info in prefills:
            address = info.kv_address
            if not address:
                continue
            listed_at[address] = now
            if address not in self.connecting and not self.kv_client.connected(address):
                self.connecting[address] = asyncio.create_task(
                    self._connect(info.instance_id, address))
        for address in [a for a, at in listed_at.items() if now - at > gone_s]:
            del listed_at[address]
            if address not in self.connecting:
                self.kv_client.drop(address)

    async def _connect(self, instance: str, address: str) -> None:
        try:
            if await self.kv_client.connect(address):
                log.info("%s: KV endpoint to %s (%s) open", self.id, instance, address)
        finally:
            self.connecting.pop(address, None)

    async def closing(self) -> None:
        for task in [*(pull for _, pull in self.pulling.values()), *self.releasing]:
            task.cancel()
        await self.kv_client.close()
        stop_notifier_thread()

    async def _on_kv_ready(self, msg: Msg) -> None:
        ready = parse(msg, KvReady)
        await acknowledge(msg)  # a second copy (its answer lost) is dropped below
        newest = self._newest(ready.request_id)
        if ready.attempt < newest or self.cancelled.covers(ready.request_id, ready.attempt):
            self._release(ready)  # a stale announcement (moved on, or cancelled): drop it
            return
        if ready.attempt == newest:
            return  # heard twice: the copy here pulls it
        # a failover brought the request back here: an older attempt still queued or being
        # pulled is superseded (one decoding already, the engine replaces on import)
        for older in [r for r in self.pending if r.request_id == ready.request_id]:
            self.pending.remove(older)
            self._release(older)
        if ready.request_id in self.pulling:  # an older attempt's, as `newest` says
            _, pull = self.pulling.pop(ready.request_id)
            pull.cancel()  # its blocks are freed and its KV released as it ends
        self.traces[ready.request_id] = (dict(msg.headers or {}), time.time())
        self.pending.append(ready)
        self.gateways[ready.request_id] = ready.gateway
        self.room.set()

    async def _on_wanted(self, msg: Msg) -> None:
        """A prefill instance asks which of its long-parked requests this instance still
        means to pull: those queued here from it, as that attempt, those being pulled, and
        those pulled whose release it has not heard yet (kept for their retention)."""
        query = parse(msg, KvWanted)
        queued = {(r.request_id, r.attempt) for r in self.pending
                  if r.prefill_instance == query.prefill_instance}
        wanted = [request_id for request_id, attempt in query.attempts.items()
                  if (request_id, attempt) in queued or request_id in self.pulling
                  or request_id in self.releasing.values()]
        await msg.respond(KvWantedReply(wanted=wanted).model_dump_json().encode())

    async def _pull_forever(self, batch: int = 32) -> None:
        """Pull announced requests in arrival order, as many at a time as the pool holds
        (up to `batch`), their transfers and imports overlapping. Where the engine allows it
        (one rank on the CPU) their blocks are taken at once, beside the step under way, so
        a request heard mid-step can join the next step; else one engine call allocates for
        all of them after that step, and a burst costs a few steps, not two per request."""
        while True:
            await self.room.wait()
            self.room.clear()
            while self.pending:
                wanted = list(itertools.islice(self.pending, batch))
                granted = await self._on_pool(self._allocate_in_order, wanted)
                if not granted:
                    break  # no room: wait until a request finishes
                pairs = list(zip(wanted, granted, strict=False))
                queued = {id(r) for r in self.pending}  # a cancel may have taken some out
                taken = {id(r) for r, _ in pairs}
                self.pending = deque(r for r in self.pending if id(r) not in taken)
                for ready, grant in pairs:  # no await before all are in `pulling`
                    if id(ready) in queued:
                        self._start_pull(ready, grant)
                for ready, grant in pairs:
                    if id(ready) not in queued:  # freed in a task: admission goes on
                        self._free_later(grant)
                        self._reuse(grant)

    async def _on_pool(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, which takes or frees a pull's blocks: at once where the engine lets
        that run beside a step (`Engine.blocks_off_thread`: no await, so nothing else runs
        on the loop meanwhile), else on the engine thread after the step under way."""
        if self.engine.blocks_off_thread:
            return fn(*args)
        return await self.host.call(fn, *args)

    def _allocate_in_order(self, wanted: list[KvReady]) -> list[Grant]:
        """Blocks for the longest prefix of `wanted` the pool holds, each with the buffer
        rank 0's KV is received into and, with several ranks, the others' pulls of theirs
        started: one call for all (`_on_pool`: on the engine thread each call waits for
        the running step, and a pull used to make three)."""
        granted = []
        alloc = None if self.staging is None else self.staging.take
        for ready in wanted:
            found = self.engine.allocate_for(ready.computed, self._prefix(ready))
            if found is None:
                break
            self.prefixes.pop((ready.request_id, ready.attempt), None)
            blocks, held = found
            granted.append(Grant(blocks, self.engine.kv_buffer(len(blocks) - held, alloc),
                                 held))
        # where the KV cannot land here the pull fails at once (`_pull` says why), and no
        # rank is asked
        ours = self.engine.runner.kv_dtype_name
        asked = [(ready, grant) for ready, grant in zip(wanted, granted, strict=False)
                 if _mismatch(ready, grant.blocks, ours) is None]
        pulls = [KvPull(ready.request_id, ready.token, grant.blocks[grant.held:],
                        _sources(ready), grant.held) for ready, grant in asked]
        futures = self.engine.pull_on_ranks(pulls, self.settings.kv_pull_timeout_s) \
            if asked else None
        for (_, grant), future in zip(asked, futures or [], strict=False):
            grant.ranks = future
        device = self.engine.runner.device
        if granted and device.type == "cuda":  # the buffers exist before UCX writes them
            torch.cuda.current_stream(device).synchronize()
        return granted

    def _prefix(self, ready: KvReady) -> list[BlockHash]:
        """The hashes of the blocks of `ready`'s KV this pool may hold already (none where
        its prefill instance would send them all), once a request: while the pool is full
        the same requests are tried again at each request's end."""
        if not ready.skips:
            return []
        key = (ready.request_id, ready.attempt)
        hashes = self.prefixes.get(key)
        if hashes is None:
            tokens = [*ready.prompt_ids, *ready.output_ids][:ready.computed]
            hashes = self.prefixes[key] = self.engine.prefix_hashes(
                tokens, ready.sampling.cache_salt)
            while len(self.prefixes) > MOST_PREFIXES:  # those of requests no longer queued
                self.prefixes.popitem(last=False)
        return hashes

    def _start_pull(self, ready: KvReady, grant: Grant) -> asyncio.Task[None]:
        """The pull of `ready` into `grant`'s blocks, in a task of its own in `pulling`."""
        task = asyncio.create_task(self._pull(ready, grant))
        task.add_done_callback(functools.partial(self._unstarted, ready, grant))
        self.pulling[ready.request_id] = (ready.attempt, task)
        return task

    def _unstarted(self, ready: KvReady, grant: Grant, task: asyncio.Task[None]) -> None:
        """A pull cancelled before its task first ran (superseded or cancelled in the same
        turn of the loop) ran none of its body: free its blocks and release its KV here."""
        if not grant.started:
            self._free_later(grant)
            self._reuse(grant)
            self._pulled(ready.request_id, task)
            self._release(ready)

    def _reuse(self, grant: Grant) -> None:
        """`grant`'s buffer for a later pull, once nothing writes it any more: its KV is in
        the pool, or no receive ever had it (a staging buffer: on the CPU)."""
        if self.staging is not None:
            self.staging.give(grant.buffer)

    async def _pull(self, ready: KvReady, grant: Grant) -> None:
        grant.started = True
        headers, announced = self.traces.pop(ready.request_id, ({}, time.time()))
        parent = context_from(headers)
        pull_start = time.time()
        record(self.tracer, "decode queue", parent, announced, pull_start, instance=self.id)
        blocks = grant.blocks
        buffer: torch.Tensor | None = grant.buffer
        try:
            refused = _mismatch(ready, blocks, self.engine.runner.kv_dtype_name)
            if refused is not None:
                self._reuse(grant)
                raise TransferError(refused)
            # a grammar compiled off the steps' thread (admit_imported then copies it)
            await asyncio.to_thread(self.engine.prepare, ready.sampling.params())
            await pull_pieces(self.kv_client, ready.request_id, ready.token, _sources(ready),
                              self.engine.runner.kv_spans[0], grant.buffer, grant.held)
            if grant.ranks is not None:  # rank 0's part now, then the others' once landed
                grant.importing = asyncio.ensure_future(asyncio.to_thread(
                    self.engine.import_part, blocks[grant.held:], grant.buffer))
                await asyncio.shield(grant.importing)
                buffer = None
                if not await asyncio.shield(asyncio.wrap_future(grant.ranks)):
                    raise TransferError("a rank's pull of its part failed (its log says why)")
            self._pulled(ready.request_id)  # from here a cancel aborts it in the engine
            joined = time.time()
            pulled = len(blocks) - grant.held
            record(self.tracer, "kv transfer", parent, pull_start, joined, instance=self.id,
                   source=ready.prefill_instance, bytes=pulled * self.block_bytes,
                   blocks=pulled, cached_blocks=grant.held)
            self.traces[ready.request_id] = (headers, joined)
            request = Request(ready.request_id, ready.prompt_ids, ready.sampling.params(),
                              eos_ids=self.engine.eos_ids, output_ids=list(ready.output_ids),
                              output_logprobs=[] if ready.last_logprob is None
                              else [ready.last_logprob], tag=ready.attempt)
            self.attempts[ready.request_id] = ready.attempt
            await self.host.call(self.engine.admit_imported, request, blocks, buffer,
                                 ready.computed, grant.held)
            self._reuse(grant)  # copied into the pool: the next pull may land in it
        except TransferError as e:
            log.warning("pull of %s failed: %s", ready.request_id, e)
            self._pulled(ready.request_id)  # no cancel may cut its freeing short now
            await self._give_up(ready, grant, f"KV transfer failed: {e}")
        except RequestRejected as e:  # its format: no instance can serve it, so no move
            self._pulled(ready.request_id)
            await self._give_up(ready, grant, str(e), refused=True)
        except Exception as e:  # a bug: still, the blocks must not leak nor the request hang
            log.exception("import of %s failed", ready.request_id)
            self._pulled(ready.request_id)
            await self._give_up(ready, grant, f"KV import failed: {e}")
        except asyncio.CancelledError:  # the request was cancelled (or the worker stops)
            await self._free(grant)
        finally:
            self._pulled(ready.request_id)
            self._release(ready)  # imported, or given up

    def _free_later(self, grant: Grant) -> None:
        freeing = asyncio.create_task(self._free(grant))
        self.freeing.add(freeing)
        freeing.add_done_callback(self.freeing.discard)

    async def _free(self, grant: Grant) -> None:
        """Free a pull's blocks once nothing may still write them: rank 0's import of its
        part, and the other ranks' pulls (each answers by its deadline, or dies)."""
        with contextlib.suppress(Exception):
            if grant.importing is not None:
                await asyncio.shield(grant.importing)
            if grant.ranks is not None:
                await asyncio.shield(asyncio.wrap_future(grant.ranks))
        await self._on_pool(self.engine.free, grant.blocks)
        self.room.set()

    async def _give_up(self, ready: KvReady, grant: Grant, error: str,
                       refused: bool = False) -> None:
        """Free the blocks taken for a pull that failed and ask the gateway to move it; or,
        `refused`, tell it the request cannot be served anywhere (a 400)."""
        await self._free(grant)
        await self.send(TokenChunk(request_id=ready.request_id, source=self.id,
                                   seq=len(ready.output_ids), attempt=ready.attempt,
                                   retry=not refused, refused=refused, error=error))

    def _release(self, ready: KvReady) -> None:
        """Tell the prefill instance it may free the request's KV (after its retention), in
        a task of its own."""
        task = asyncio.create_task(self._release_until_heard(ready))
        self.releasing[task] = ready.request_id
        task.add_done_callback(lambda done: self.releasing.pop(done, None))

    async def _release_until_heard(self, ready: KvReady, first_s: float = 1.0,
                                   most_s: float = 8.0) -> None:
        """A lost release would park the KV until the prefill instance asks whether it is
        still wanted: ask until the prefill instance answers or a lease's time has passed,
        backing off (a dead prefill instance is asked a few times per request, not once a
        second). "No responders" is asked again too: just after a NATS restart the prefill
        instance may not have subscribed again yet. Until then the KV counts as wanted."""
        message = ReleaseKv(request_id=ready.request_id,
                            attempt=ready.attempt).model_dump_json().encode()
        deadline = time.monotonic() + self.settings.kv_lease_s
        wait_s = first_s
        while time.monotonic() < deadline:
            try:
                await self.nc.request(subjects.release(ready.prefill_instance), message,
                                      timeout=first_s)
                return
            except (nats.errors.Error, OSError):  # NATS down, the answer lost, not back yet
                await asyncio.sleep(wait_s)
                wait_s = min(2 * wait_s, most_s)

    def _pulled(self, request_id: str, task: asyncio.Task[None] | None = None) -> None:
        """`task` (the running one by default) no longer pulls the request."""
        if self.pulling.get(request_id, (0, None))[1] is (task or asyncio.current_task()):
            del self.pulling[request_id]

    async def on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            await self.stream(out)
            if out.finished:  # its blocks are free: at the end, or after an error
                self.room.set()
                if out.tag < self._newest(out.request_id):
                    continue  # an older copy's end: the newer attempt's trace goes on
                traced = self.traces.pop(out.request_id, None)  # None: cancelled meanwhile
                if traced is not None:
                    headers, joined = traced
                    record(self.tracer, "decode run", context_from(headers), joined,
                           time.time(), instance=self.id,
                           finish_reason=out.finish_reason or "error")

    def aborted(self) -> None:
        self.room.set()  # its blocks are free: a pull waiting for room may fit now

    def cancel(self, cancel: Cancel) -> None:
        """Drop each copy of the request the cancel covers, wherever it is (queued, being
        pulled, decoding): all of them when the client left; when the gateway moved the
        request away, those of the attempts up to the one it names, not a later attempt that
        came back here meanwhile (the cancel and the new announcement travel apart)."""
        request_id = self.cancel_for_me(cancel)
        if request_id is None:
            return
        stale = functools.partial(self.cancelled.covers, request_id)
        for ready in [r for r in self.pending if r.request_id == request_id and
                      stale(r.attempt)]:
            self.pending.remove(ready)
            self._release(ready)
        attempt, pull = self.pulling.get(request_id, (0, None))
        if pull is not None and stale(attempt):
            del self.pulling[request_id]
            pull.cancel()  # its blocks are freed as it ends
        if request_id in self.attempts and stale(self.attempts[request_id]):
            del self.attempts[request_id]
            self.abort(request_id)
        if not self.holds(request_id):
            self.traces.pop(request_id, None)

    def _newest(self, request_id: str) -> int:
        """The newest attempt of the request this instance holds (queued, being pulled or
        decoding), -1 for none."""
        attempts = [r.attempt for r in self.pending if r.request_id == request_id]
        if request_id in self.pulling:
            attempts.append(self.pulling[request_id][0])
        return max([*attempts, self.attempts.get(request_id, -1)])

    def held(self) -> dict[str, int]:
        held = {ready.request_id: ready.attempt for ready in list(self.pending)}
        held |= {request_id: attempt for request_id, (attempt, _) in list(self.pulling.items())}
        return held | dict(self.attempts)

