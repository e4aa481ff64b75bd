"""A decode instance: its own engine (decode role). Announced requests wait in `pending`
until the pool has room; then the KV is pulled over UCX straight into a buffer that is
imported at this pool's block ids, the prefill instance is told to free its copy, and the
request joins the running batch."""

from __future__ import annotations

import asyncio
import logging
from collections import deque

import torch
from nats.aio.msg import Msg
from redis.asyncio import Redis

from services.runtime import EngineHost, WorkerSettings, heartbeat_forever
from shared import subjects
from shared.bus import connect, parse, publish
from shared.engine.config import Role
from shared.engine.engine import Engine, RequestOutput
from shared.engine.request import Request
from shared.kv_transfer import KvClient, TransferError
from shared.messages import Cancel, KvReady, ReleaseKv, TokenChunk
from shared.state import InstanceInfo, Registry

log = logging.getLogger(__name__)


class DecodeService:
    def __init__(self, settings: WorkerSettings, engine: Engine | None = None) -> None:
        self.settings = settings.named("decode")
        self.id = self.settings.instance_id
        self.engine = engine or Engine(self.settings.engine_config(Role.DECODE))
        self.host = EngineHost(self.engine)
        self.kv_client = KvClient()
        self.pending: deque[KvReady] = deque()
        self.room = asyncio.Event()  # set when something may have become pullable

    def info(self) -> InstanceInfo:
        blocks = self.engine.blocks
        return InstanceInfo(instance_id=self.id, role="decode", queue_len=len(self.pending),
                            running=len(self.engine.scheduler.running),
                            free_blocks=blocks.num_free, total_blocks=blocks.num_blocks,
                            kv_requests=self.kv_client.stats.requests,
                            kv_bytes=self.kv_client.stats.bytes)

    async def run(self, stop: asyncio.Event) -> None:
        self.nc = await connect(self.settings.nats_url, self.id)
        redis = Redis.from_url(self.settings.redis_url)
        registry = Registry(redis, self.settings.heartbeat_ttl_s)
        await self.nc.subscribe(subjects.decode(self.id), cb=self._on_kv_ready)
        await self.nc.subscribe(subjects.CANCEL_ALL, cb=self._on_cancel)
        tasks = [asyncio.create_task(self.host.run(self._on_outputs)),
                 asyncio.create_task(self._pull_forever()),
                 asyncio.create_task(heartbeat_forever(registry, self.info,
                                                       self.settings.heartbeat_s))]
        log.info("decode %s ready", self.id)
        await stop.wait()
        for task in tasks:
            task.cancel()
        await registry.remove(self.id, "decode")
        await self.kv_client.close()
        await self.nc.drain()
        await redis.aclose()

    async def _on_kv_ready(self, msg: Msg) -> None:
        self.pending.append(parse(msg, KvReady))
        self.room.set()

    async def _pull_forever(self) -> None:
        while True:
            await self.room.wait()
            self.room.clear()
            while self.pending:
                ready = self.pending[0]
                blocks = await self.host.call(self.engine.allocate, len(ready.prompt_ids))
                if blocks is None:
                    break  # no room: wait until a request finishes
                self.pending.popleft()
                await self._pull(ready, blocks)

    async def _pull(self, ready: KvReady, blocks: list[int]) -> None:
        kv = self.engine.runner.kv
        shape = (*kv.data.shape[:2], len(blocks), *kv.data.shape[3:])
        buffer = torch.empty(shape, dtype=kv.data.dtype, device=kv.data.device)
        try:
            if ready.num_blocks != len(blocks):
                raise TransferError(f"prefill sent {ready.num_blocks} blocks, expected "
                                    f"{len(blocks)}: block sizes differ")
            target = buffer.numpy() if buffer.device.type == "cpu" else buffer
            await self.kv_client.pull(ready.kv_address, ready.request_id, target)
        except TransferError as e:
            log.warning("pull of %s failed: %s", ready.request_id, e)
            await self.host.call(self.engine.free, blocks)
            await self._send(TokenChunk(request_id=ready.request_id, source=self.id,
                                        error=f"KV transfer failed: {e}"))
            return
        finally:
            await publish(self.nc, subjects.release(ready.prefill_instance),
                          ReleaseKv(request_id=ready.request_id))
        request = Request(ready.request_id, ready.prompt_ids, ready.sampling.params(),
                          eos_id=self.engine.eos_id, output_ids=[ready.first_token],
                          output_logprobs=[] if ready.first_logprob is None
                          else [ready.first_logprob])
        await self.host.call(self.engine.admit_imported, request, blocks, buffer)
        self.host.wake()

    async def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            await self._send(TokenChunk(request_id=out.request_id, token_ids=out.new_token_ids,
                                        text=out.new_text, logprobs=out.logprobs,
                                        finish_reason=out.finish_reason, source=self.id))
            if out.finished:
                self.room.set()

    async def _on_cancel(self, msg: Msg) -> None:
        request_id = parse(msg, Cancel).request_id
        for ready in list(self.pending):
            if ready.request_id == request_id:
                self.pending.remove(ready)
                await publish(self.nc, subjects.release(ready.prefill_instance),
                              ReleaseKv(request_id=request_id))
                return
        if await self.host.call(self.engine.abort, request_id):
            self.room.set()

    async def _send(self, chunk: TokenChunk) -> None:
        await publish(self.nc, subjects.tokens(chunk.request_id), chunk)
