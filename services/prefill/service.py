"""A prefill instance: its own engine (prefill role), a UCX listener serving parked KV, and
NATS subscriptions for requests, releases, resumes and cancellations. Its memory is the queue
buffer: a request's blocks stay until the decode instance has imported them and a short
retention has passed (so a request whose decode instance dies can resume from them on
another), or until a lease expires."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import nats.errors
import torch
from nats.aio.msg import Msg

from services.process import WorkerSettings
from services.runtime import Worker
from shared import subjects
from shared.bus import acknowledge, deliver, parse
from shared.engine.config import Role
from shared.engine.engine import Engine, RequestOutput
from shared.engine.kv_cache import Staging
from shared.engine.parallel.layout import KvSpan
from shared.engine.request import Request
from shared.kv_transfer import KvServer, Served, stop_notifier_thread, unwire, wire
from shared.messages import (
    Cancel,
    KvReady,
    KvSource,
    KvWanted,
    KvWantedReply,
    PrefillRequest,
    ReleaseKv,
    Resume,
    ResumeReply,
    TokenChunk,
)
from shared.state import InstanceInfo
from shared.telemetry import context_from, record

log = logging.getLogger(__name__)


class PrefillService(Worker):
    role = "prefill"
    engine_role = Role.PREFILL

    def __init__(self, settings: WorkerSettings, engine: Engine | None = None) -> None:
        super().__init__(settings, engine)
        self.kv_server = KvServer(lookup=self._lookup, host=self.settings.host,
                                  port=self.settings.kv_port, on_served=self._served,
                                  sent=self._sent)
        # the exports' buffers on the CPU, reused pull after pull, those of a
        # prompt as long as a prefill step's tokens laid ready
        self.staging = Staging.for_pool(self.engine.runner.kv,
                                        self.settings.max_batch_tokens)
        self.requests: dict[str, PrefillRequest] = {}
        self.parked_at: dict[str, float] = {}
        self.released_at: dict[str, float] = {}  # imported by a decode instance; retained
        self.asked_at: dict[str, float] = {}  # last asked whether its decode side wants it
        self.admitting: dict[str, int] = {}  # request -> the attempt being queued
        self.copies: dict[str, int] = {}  # request -> its engine copy's admission number
        self.decode_seen: dict[str, float] = {}  # decode instance -> its last heartbeat
        self.arrived: dict[str, tuple[float, dict[str, str]]] = {}  # time, trace headers
        self.traced: dict[str, dict[str, str]] = {}  # a parked request's trace headers
        self.sources: list[KvSource] = []  # the ranks' KV listeners, once they listen

    def info(self) -> InstanceInfo:
        requests, nbytes = self.engine.kv_moved_on_ranks()  # the pulls the others served
        return super().info().model_copy(update={
            "kv_address": self.kv_server.address, "running": len(self.engine.scheduler.parked),
            "kv_requests": self.kv_server.stats.requests + requests,
            "kv_bytes": self.kv_server.stats.bytes + nbytes})

    async def _lookup(self, request_id: str, part: KvSpan | None, skip: int) -> Any:
        """Called by the UCX listener: `part` of the parked request's blocks that rank 0
        holds but the first `skip` (the other ranks serve theirs), as one buffer, complete
        before UCX reads it. On a GPU the copy runs on the engine thread (its stream, then
        synchronised). Otherwise it runs on a thread of its own, not queued behind the step
        in progress (seconds, for long prompts): it reads only the parked request's blocks,
        which no step writes, and the copy is done when it returns."""
        if self.engine.exports_off_thread:
            return await asyncio.to_thread(self._export, request_id, part, skip)
        return await self.host.call(self._export, request_id, part, skip)

    def _served(self, served: Served) -> None:
        """A pull answered: a "kv export" span in the request's trace, from the pull's header
        to its last byte sent (`copy_s`: the copy out of the pool), the prefill side of the
        decode instance's "kv transfer\"."""
        headers = self.traced.get(served.request_id)
        if headers is not None:
            record(self.tracer, "kv export", context_from(headers), served.asked, served.sent,
                   instance=self.id, bytes=served.nbytes,
                   copy_s=round(served.found - served.asked, 6))

    def _export(self, request_id: str, part: KvSpan | None, skip: int = 0) -> Any:
        """The copy out of the pool: on the CPU into a staging buffer, taken back once sent
        (`_sent`); a GPU's caching allocator reuses its own."""
        buffer = self.engine.export_part(
            request_id, part, None if self.staging is None else self.staging.take, skip)
        if buffer is None:
            return None
        if buffer.device.type == "cuda":
            torch.cuda.current_stream(buffer.device).synchronize()  # the copy is asynchronous
        return wire(buffer)

    def _sent(self, sent: Any) -> None:
        """An export UCX is done with: its staging buffer (the tensor a CPU buffer's bytes
        are a view of) serves the next one."""
        if self.staging is not None and (lent := unwire(sent)) is not None:
            self.staging.give(lent)

    def subscriptions(self) -> dict[str, Callable[[Msg], Awaitable[None]]]:
        """Listen for pulls (each rank on a listener of its own, under rank 0's key; before
        the engine loop starts, so the engine thread is idle), then subscribe."""
        self.kv_server.start()
        addresses = [self.kv_server.address, *self.engine.serve_kv(self.settings.host,
                                                                   self.kv_server.key)]
        self.sources = [KvSource.of(address, span) for address, span
                        in zip(addresses, self.engine.runner.kv_spans, strict=True)]
        log.info("prefill %s: KV listener%s on %s", self.id, "s" if len(addresses) > 1 else "",
                 ", ".join(addresses))
        return {subjects.prefill(self.id): self._on_request,
                subjects.release(self.id): self._on_release, subjects.CANCEL_ALL: self._on_cancel,
                subjects.resume(self.id): self._on_resume, subjects.HEARTBEATS: self._on_heartbeat}

    def background(self) -> list[Coroutine[Any, Any, None]]:
        return [self._expire_leases()]

    async def closing(self) -> None:
        self.kv_server.close()
        stop_notifier_thread()

    async def _on_request(self, msg: Msg) -> None:
        req = parse(msg, PrefillRequest)
        await acknowledge(msg)
        held = self.requests.get(req.request_id)
        if held is not None and req.attempt <= held.attempt:
            return  # a newer attempt came first, or this one again (its answer was lost)
        if held is not None:  # an older attempt of it is still here
            self._forget(req.request_id)
        self.requests[req.request_id] = req
        self.gateways[req.request_id] = req.gateway
        self.arrived[req.request_id] = (time.time(), dict(msg.headers or {}))
        # until the engine has this attempt, its outputs are an older attempt's
        self.admitting[req.request_id] = req.attempt
        self.take_in(self._admit(req))

    async def _admit(self, req: PrefillRequest) -> None:
        try:
            request = await self.admit(req)
        finally:
            if self.admitting.get(req.request_id) == req.attempt:
                del self.admitting[req.request_id]
        if self.requests.get(req.request_id) is not req:
            return  # a newer attempt arrived meanwhile: it replaces (or drops) this one
        if request is None:  # rejected: the older attempt it replaces goes too
            self._forget(req.request_id)
            await self.host.call(self.engine.abort, req.request_id)
        else:
            self.copies[req.request_id] = request.arrival

    async def on_outputs(self, outputs: list[RequestOutput]) -> None:
        now = time.time()
        for out in outputs:
            req = self.requests.get(out.request_id)
            if req is None or not self._current(out.request_id, out.arrival):
                continue  # cancelled, or an attempt a newer one replaces
            await self.stream(out)
            if out.error is not None:  # the engine aborted it and freed its blocks
                self._forget(out.request_id)
                continue
            arrived, headers = self.arrived.pop(out.request_id, (now, {}))
            started = max(arrived, self.host.step_started)
            parent = context_from(headers)
            record(self.tracer, "prefill queue", parent, arrived, started, instance=self.id)
            record(self.tracer, "prefill run", parent, started, now, instance=self.id,
                   prompt_tokens=len(req.prompt_ids))
            parked = self.engine.scheduler.parked.get(out.request_id) if out.parked else None
            if parked is not None:
                self.parked_at[out.request_id] = now
                self.traced[out.request_id] = headers
                await self._announce(req, parked, parked.output_ids,
                                     out.logprobs[0] if out.logprobs else None, now, headers)
            elif out.finished:
                self._forget(out.request_id)

    async def _announce(self, req: PrefillRequest, parked: Request, output_ids: list[int],
                        last_logprob: float | None, first_token_ts: float,
                        headers: dict[str, str] | None = None) -> None:
        """Tell the request's decode instance its KV (`parked`) waits here, in a task of its
        own (`detach`): the engine loop goes on while it is acknowledged."""
        ready = KvReady(request_id=req.request_id, prefill_instance=self.id,
                        sources=self.sources, token=self.kv_server.token(req.request_id),
                        num_blocks=len(parked.block_table), prompt_ids=req.prompt_ids,
                        output_ids=output_ids, last_logprob=last_logprob,
                        computed=parked.num_computed, sampling=req.sampling,
                        arrival_ts=req.arrival_ts, first_token_ts=first_token_ts,
                        attempt=req.attempt, kv_dtype=self.engine.runner.kv_dtype_name,
                        gateway=req.gateway, skips=True)
        self.detach(self._deliver(req.decode_instance, ready, headers), "a KV announcement")

    async def _deliver(self, decode: str, ready: KvReady,
                       headers: dict[str, str] | None) -> None:
        """Send `ready` until `decode` acknowledges it (NATS delivers at most once: one sent
        as the connection dropped was lost without a word, and the request waited, its
        decode instance busy with others, for the client's timeout). One never acknowledged
        asks the gateway to move the request, as a failed pull does; the KV stays here for
        the move to resume from, and is freed when no decode instance wants it."""
        why = await deliver(self.nc, subjects.decode(decode), ready, headers,
                            self.settings.dispatch_tries, self.settings.dispatch_ack_s)
        held = self.requests.get(ready.request_id)
        if why is None or held is None or held.attempt != ready.attempt:
            return  # heard; or the request ended here meanwhile (cancelled, moved on)
        log.warning("%s: %s never acknowledged the KV of %s (attempt %d): %s; moving it",
                    self.id, decode, ready.request_id, ready.attempt, why)
        await self.send(TokenChunk(request_id=ready.request_id, source=self.id,
                                   seq=len(ready.output_ids), attempt=ready.attempt,
                                   retry=True, error=f"{decode} never acknowledged its KV "
                                                     f"announcement: {why}"))

    def _current(self, request_id: str, arrival: int) -> bool:
        """Whether an engine copy of the request (by its admission number) is the attempt
        this instance serves now, not one a newer attempt is replacing or has replaced."""
        return request_id not in self.admitting and self.copies.get(request_id) == arrival

    async def _on_resume(self, msg: Msg) -> None:
        """A gateway moves a request to another decode instance: if its KV is still here,
        announce it there (with the tokens streamed since, to replay) and say so."""
        resume = parse(msg, Resume)
        held = await self._resume(resume)
        await msg.respond(ResumeReply(held=held).model_dump_json().encode())

    async def _resume(self, resume: Resume) -> bool:
        req = self.requests.get(resume.request_id)
        parked = self.engine.scheduler.parked.get(resume.request_id)
        if req is None or parked is None or not self._current(req.request_id, parked.arrival) \
                or resume.output_ids[:len(parked.output_ids)] != parked.output_ids:
            return False
        req = req.model_copy(update={"decode_instance": resume.decode_instance,
                                     "attempt": resume.attempt})
        self.requests[req.request_id] = req
        self.released_at.pop(req.request_id, None)
        self.parked_at[req.request_id] = time.time()  # a new lease for the new holder
        await self._announce(req, parked, resume.output_ids, None, time.time())
        return True

    def _forget(self, request_id: str) -> None:
        """Drop what is kept of the request; its attempt is over here (replaced, failed,
        cancelled, its KV freed), and a late copy of it (its acknowledgement lost) is not
        prefilled again."""
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.cancelled.add(request_id, req.attempt)
        self.arrived.pop(request_id, None)
        self.traced.pop(request_id, None)
        self.parked_at.pop(request_id, None)
        self.released_at.pop(request_id, None)
        self.asked_at.pop(request_id, None)
        self.copies.pop(request_id, None)
        self.attempts.pop(request_id, None)

    async def on_stalled(self) -> bool:
        """No waiting prompt fits the pool: free the KV retained longest (its decode
        instance has it already; it is kept only to resume the request faster should that
        instance fail), one request a try. Retained for kv_retention_s, 8 requests/s of
        124-token prompts filled a 256 MiB pool and held new prompts back."""
        if not self.released_at:
            return False
        oldest = min(self.released_at, key=self.released_at.__getitem__)
        log.debug("%s: the pool is full; freeing the retained KV of %s", self.id, oldest)
        await self._free(oldest)
        return True

    async def _free(self, request_id: str) -> None:
        self._forget(request_id)
        await self.host.call(self.engine.release, request_id)

    async def _on_release(self, msg: Msg) -> None:
        """The decode instance has the KV: keep it the retention more, then free it."""
        release = parse(msg, ReleaseKv)
        request_id, req = release.request_id, self.requests.get(release.request_id)
        if request_id in self.parked_at and req is not None and req.attempt == release.attempt:
            self.released_at.setdefault(request_id, time.time())
            self.host.wake()  # a stalled engine may take its blocks now (on_stalled)
        if msg.reply:  # the decode instance asks until it hears this
            await msg.respond(b"")

    def held(self) -> dict[str, int]:
        return {request_id: req.attempt for request_id, req in list(self.requests.items())}

    def cancel(self, cancel: Cancel) -> None:
        request_id = self.cancel_for_me(cancel)
        if request_id is None:
            return
        req = self.requests.get(request_id)
        if req is not None and not self.cancelled.covers(request_id, req.attempt):
            return  # it names an older attempt than the one here now: that one stays
        if req is not None:
            self._forget(request_id)
            self.abort(request_id)
        self.arrived.pop(request_id, None)

    async def _on_heartbeat(self, msg: Msg) -> None:
        info = parse(msg, InstanceInfo)
        if info.role == "decode":
            self.decode_seen[info.instance_id] = time.time()

    def _abandoned(self, request_id: str, now: float) -> bool:
        """Nobody will pull this KV: its decode instance has been silent for the lease (a
        live one with a queue of pulls keeps it), or it was parked for the longest hold.
        KV already imported is kept for its retention whatever its decode instance does:
        that is when a failover needs it."""
        if request_id in self.released_at:
            return False
        parked = self.parked_at[request_id]
        req = self.requests.get(request_id)
        seen = self.decode_seen.get(req.decode_instance, 0.0) if req else 0.0
        return now - max(seen, parked) > self.settings.kv_lease_s or \
            now - parked > self.settings.kv_max_hold_s

    async def _expire_leases(self) -> None:
        """Free the KV of requests whose retention after the import has passed, and of those
        no decode instance will pull (it died, or the request was cancelled before the pull
        and the cancel was lost)."""
        while True:
            await asyncio.sleep(min(0.5, self.settings.kv_lease_s / 4))
            now = time.time()
            retained = [r for r, at in self.released_at.items()
                        if now - at >= self.settings.kv_retention_s]
            for request_id in retained:
                await self._free(request_id)
            for request_id in [r for r in self.parked_at if self._abandoned(r, now)]:
                log.warning("KV lease of %s expired: freeing its blocks", request_id)
                await self._free(request_id)
            await self._free_unwanted(now)

    async def _free_unwanted(self, now: float) -> None:
        """KV parked a lease's time without a release: ask its decode instance (alive, or
        the lease would have freed it) whether it still means to pull it, and free what it
        does not: its announcement, release or the gateway's cancel was lost (NATS
        restarted). No answer decides nothing: the lease, or the next ask, will."""
        due: dict[str, dict[str, int]] = defaultdict(dict)  # decode instance -> attempts
        for request_id in self._unreleased(now):
            req = self.requests[request_id]
            due[req.decode_instance][request_id] = req.attempt
            self.asked_at[request_id] = now
        await asyncio.gather(*(self._ask(decode, attempts) for decode, attempts in due.items()))

    def _unreleased(self, now: float) -> list[str]:
        """Parked requests neither released nor asked about for a lease."""
        lease = self.settings.kv_lease_s
        return [r for r, parked in self.parked_at.items()
                if r in self.requests and r not in self.released_at
                and now - max(parked, self.asked_at.get(r, 0.0)) > lease]

    async def _ask(self, decode: str, attempts: dict[str, int], timeout_s: float = 2.0) -> None:
        query = KvWanted(prefill_instance=self.id, attempts=attempts)
        try:
            reply = await self.nc.request(subjects.wanted(decode),
                                          query.model_dump_json().encode(), timeout=timeout_s)
            wanted = set(KvWantedReply.model_validate_json(reply.data).wanted)
        except (nats.errors.Error, OSError, ValueError):
            return
        for request_id, attempt in attempts.items():
            req = self.requests.get(request_id)  # as it is now, after the wait
            still_parked = request_id in self.parked_at and request_id not in self.released_at
            if request_id not in wanted and still_parked and req is not None \
                    and req.attempt == attempt:
                log.warning("KV of %s parked %.0f s is not wanted by %s: freeing its blocks",
                            request_id, time.time() - self.parked_at[request_id], decode)
                await self._free(request_id)
