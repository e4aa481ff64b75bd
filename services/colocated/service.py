"""A colocated worker: the engine's colocated role (vLLM-style, or chunked prefill) behind the
same gateway and messages as the disaggregated instances, so one client and one benchmark
compare both designs."""

from __future__ import annotations

import asyncio
import logging

from nats.aio.msg import Msg
from redis.asyncio import Redis

from services.runtime import EngineHost, WorkerSettings, heartbeat_forever
from shared import subjects
from shared.bus import connect, parse, publish
from shared.engine.config import Role
from shared.engine.engine import Engine, RequestOutput, RequestRejected
from shared.messages import Cancel, PrefillRequest, TokenChunk
from shared.state import InstanceInfo, Registry

log = logging.getLogger(__name__)


class ColocatedService:
    def __init__(self, settings: WorkerSettings, engine: Engine | None = None) -> None:
        self.settings = settings.named("colocated")
        self.id = self.settings.instance_id
        self.engine = engine or Engine(self.settings.engine_config(Role.COLOCATED))
        self.host = EngineHost(self.engine)
        self.known: set[str] = set()

    def info(self) -> InstanceInfo:
        blocks = self.engine.blocks
        return InstanceInfo(instance_id=self.id, role="colocated",
                            queue_len=len(self.engine.scheduler.waiting),
                            running=len(self.engine.scheduler.running),
                            free_blocks=blocks.num_free, total_blocks=blocks.num_blocks)

    async def run(self, stop: asyncio.Event) -> None:
        self.nc = await connect(self.settings.nats_url, self.id)
        redis = Redis.from_url(self.settings.redis_url)
        registry = Registry(redis, self.settings.heartbeat_ttl_s)
        await self.nc.subscribe(subjects.prefill(self.id), cb=self._on_request)
        await self.nc.subscribe(subjects.CANCEL_ALL, cb=self._on_cancel)
        tasks = [asyncio.create_task(self.host.run(self._on_outputs)),
                 asyncio.create_task(heartbeat_forever(registry, self.info,
                                                       self.settings.heartbeat_s))]
        log.info("colocated %s ready", self.id)
        await stop.wait()
        for task in tasks:
            task.cancel()
        await registry.remove(self.id, "colocated")
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
        self.known.add(req.request_id)
        self.host.wake()

    async def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            await self._send(TokenChunk(request_id=out.request_id, token_ids=out.new_token_ids,
                                        text=out.new_text, logprobs=out.logprobs,
                                        finish_reason=out.finish_reason, source=self.id))
            if out.finished:
                self.known.discard(out.request_id)

    async def _on_cancel(self, msg: Msg) -> None:
        request_id = parse(msg, Cancel).request_id
        if request_id in self.known:
            self.known.discard(request_id)
            await self.host.call(self.engine.abort, request_id)

    async def _send(self, chunk: TokenChunk) -> None:
        await publish(self.nc, subjects.tokens(chunk.request_id), chunk)
