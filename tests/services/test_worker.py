"""A worker whose engine loop dies leaves dispatch and exits loudly (real NATS and Valkey,
a tiny random-weight engine)."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.asyncio import Redis

from services.colocated.service import ColocatedService
from services.runtime import WorkerFailed, WorkerSettings
from shared import subjects
from shared.bus import connect, publish
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine, RequestOutput
from shared.messages import PrefillRequest, Sampling
from shared.state import Registry


class BrokenEngine(Engine):
    def step(self) -> list[RequestOutput]:
        raise RuntimeError("the device fell over")


@pytest.mark.timeout(120)
def test_engine_failure_takes_the_worker_out_of_dispatch(nats_url: str, redis_url: str) -> None:
    settings = WorkerSettings(instance_id="colocated-x", nats_url=nats_url, redis_url=redis_url,
                              model="tiny", heartbeat_s=0.1)
    worker = ColocatedService(settings, BrokenEngine(EngineConfig(model="tiny")))

    async def main() -> None:
        stop = asyncio.Event()
        running = asyncio.create_task(worker.run(stop))
        registry = Registry(Redis.from_url(redis_url))
        while not await registry.instances("colocated"):
            await asyncio.sleep(0.05)
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
