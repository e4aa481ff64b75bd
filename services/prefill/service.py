"""A prefill instance: its own engine (prefill role), a UCX listener serving parked KV, and
NATS subscriptions for requests, releases and cancellations. Its memory is the queue buffer:
a request's blocks stay until the decode instance has pulled them, or a lease expires."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from nats.aio.msg import Msg
from redis.asyncio import Redis

from services.runtime import EngineHost, WorkerSettings, heartbeat_forever
from shared import subjects
from shared.bus import connect, parse, publish
from shared.engine.config import Role
from shared.engine.engine import Engine, RequestOutput, RequestRejected
from shared.kv_transfer import KvServer
from shared.messages import Cancel, KvReady, PrefillRequest, ReleaseKv, TokenChunk
from shared.state import InstanceInfo, Registry

log = logging.getLogger(__name__)


class PrefillService:
    def __init__(self, settings: WorkerSettings, engine: Engine | None = None) -> None:
        self.settings = settings.named("prefill")
        self.id = self.settings.instance_id
        self.engine = engine or Engine(self.settings.engine_config(Role.PREFILL))
        self.host = EngineHost(self.engine)
        self.kv_server = KvServer(lookup=self._lookup, host=self.settings.host)
        self.requests: dict[str, PrefillRequest] = {}
        self.parked_at: dict[str, float] = {}

    def info(self) -> InstanceInfo:
        blocks = self.engine.blocks
        return InstanceInfo(instance_id=self.id, role="prefill",
                            kv_address=self.kv_server.address,
                            queue_len=len(self.engine.scheduler.waiting),
                            running=len(self.engine.scheduler.parked),
                            free_blocks=blocks.num_free, total_blocks=blocks.num_blocks,
                            kv_requests=self.kv_server.stats.requests,
                            kv_bytes=self.kv_server.stats.bytes)

    def _lookup(self, request_id: str) -> Any:
        """Called by the UCX listener: the parked request's blocks as one buffer."""
        if request_id not in self.engine.scheduler.parked:
            return None
        buffer = self.engine.export_kv(request_id)
        return buffer.numpy() if buffer.device.type == "cpu" else buffer

    async def run(self, stop: asyncio.Event) -> None:
        self.nc = await connect(self.settings.nats_url, self.id)
        redis = Redis.from_url(self.settings.redis_url)
        registry = Registry(redis, self.settings.heartbeat_ttl_s)
        self.kv_server.start()
        await self.nc.subscribe(subjects.prefill(self.id), cb=self._on_request)
        await self.nc.subscribe(subjects.release(self.id), cb=self._on_release)
        await self.nc.subscribe(subjects.CANCEL_ALL, cb=self._on_cancel)
        tasks = [asyncio.create_task(self.host.run(self._on_outputs)),
                 asyncio.create_task(heartbeat_forever(registry, self.info,
                                                       self.settings.heartbeat_s)),
                 asyncio.create_task(self._expire_leases())]
        log.info("prefill %s ready: KV listener %s", self.id, self.kv_server.address)
        await stop.wait()
        for task in tasks:
            task.cancel()
        await registry.remove(self.id, "prefill")
        self.kv_server.close()
        await self.nc.drain()
        await redis.aclose()

    async def _on_request(self, msg: Msg) -> None:
        req = parse(msg, PrefillRequest)
        try:
            await self.host.call(self.engine.add_request, req.request_id, req.prompt_ids,
                                 req.sampling.params())
        except (RequestRejected, ValueError) as e:
            await self._send(TokenChunk(request_id=req.request_id, error=str(e),
                                        source=self.id))
            return
        self.requests[req.request_id] = req
        self.host.wake()

    async def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        now = time.time()
        for out in outputs:
            req = self.requests.get(out.request_id)
            if req is None:
                continue
            await self._send(TokenChunk(request_id=out.request_id, token_ids=out.new_token_ids,
                                        text=out.new_text, logprobs=out.logprobs,
                                        finish_reason=out.finish_reason, source=self.id))
            if out.parked:
                self.parked_at[out.request_id] = now
                parked = self.engine.scheduler.parked[out.request_id]
                await publish(self.nc, subjects.decode(req.decode_instance), KvReady(
                    request_id=req.request_id, prefill_instance=self.id,
                    kv_address=self.kv_server.address, num_blocks=len(parked.block_table),
                    prompt_ids=req.prompt_ids, first_token=out.new_token_ids[0],
                    first_logprob=out.logprobs[0] if out.logprobs else None,
                    sampling=req.sampling, arrival_ts=req.arrival_ts, first_token_ts=now))
            elif out.finished:
                self.requests.pop(out.request_id, None)

    async def _free(self, request_id: str) -> None:
        self.parked_at.pop(request_id, None)
        self.requests.pop(request_id, None)
        await self.host.call(self.engine.release, request_id)
        self.host.wake()  # freed blocks may let waiting prompts in

    async def _on_release(self, msg: Msg) -> None:
        await self._free(parse(msg, ReleaseKv).request_id)

    async def _on_cancel(self, msg: Msg) -> None:
        request_id = parse(msg, Cancel).request_id
        if request_id in self.requests:
            self.parked_at.pop(request_id, None)
            self.requests.pop(request_id, None)
            await self.host.call(self.engine.abort, request_id)

    async def _expire_leases(self) -> None:
        """Free the KV of requests no decode instance pulled in time (it died, or the
        request was cancelled before the pull)."""
        while True:
            await asyncio.sleep(min(1.0, self.settings.kv_lease_s / 4))
            deadline = time.time() - self.settings.kv_lease_s
            for request_id in [r for r, t in self.parked_at.items() if t < deadline]:
                log.warning("KV lease of %s expired: freeing its blocks", request_id)
                await self._free(request_id)

    async def _send(self, chunk: TokenChunk) -> None:
        await publish(self.nc, subjects.tokens(chunk.request_id), chunk)
