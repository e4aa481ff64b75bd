"""What every worker process shares: settings, the engine host, heartbeats, shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.engine.config import EngineConfig, Role
from shared.engine.engine import Engine, RequestOutput
from shared.state import InstanceInfo, Registry

T = TypeVar("T")
log = logging.getLogger(__name__)


class WorkerSettings(BaseSettings):
    """A worker's configuration: DS_* environment variables (the launcher sets them)."""

    model_config = SettingsConfigDict(env_prefix="DS_")

    instance_id: str = ""
    nats_url: str = "nats://127.0.0.1:4222"
    redis_url: str = "redis://127.0.0.1:6379"
    host: str = "127.0.0.1"  # address others reach this instance's KV listener on
    model: str = "smollm2-135m"
    device: str = "auto"
    dtype: str = "auto"
    threads: int = 0
    kv_cache_mb: int = 256
    block_size: int = 16
    max_batch_tokens: int = 512  # prefill: L_m; colocated: tokens per prefill step / chunk
    max_running: int = 64
    chunked_prefill: bool = False
    heartbeat_s: float = 0.5
    heartbeat_ttl_s: float = 2.0
    kv_lease_s: float = 30.0  # prefill frees KV nobody pulled after this long

    def engine_config(self, role: Role) -> EngineConfig:
        config = EngineConfig(model=self.model, device=self.device, dtype=self.dtype,
                              threads=self.threads, kv_cache_bytes=self.kv_cache_mb << 20)
        return config.with_scheduler(role=role, block_size=self.block_size,
                                     max_batch_tokens=self.max_batch_tokens,
                                     max_running=self.max_running,
                                     chunked_prefill=self.chunked_prefill)

    def named(self, role: str) -> WorkerSettings:
        if self.instance_id:
            return self
        return self.model_copy(update={"instance_id": f"{role}-{uuid.uuid4().hex[:6]}"})


class EngineHost:
    """Runs every engine call on one dedicated thread, in order: the event loop stays free
    for NATS, UCX and heartbeats while a step computes, and the engine needs no locks."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._wake = asyncio.Event()

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def wake(self) -> None:
        self._wake.set()

    async def run(self, on_outputs: Callable[[list[RequestOutput]], Awaitable[None]]) -> None:
        while True:
            self._wake.clear()  # before the check, so a wake during it is not lost
            if not self.engine.has_work():
                await self._wake.wait()
                continue
            outputs = await self.call(self.engine.step)
            if outputs:
                await on_outputs(outputs)


async def heartbeat_forever(registry: Registry, info: Callable[[], InstanceInfo],
                            every_s: float) -> None:
    while True:
        await registry.heartbeat(info())
        await asyncio.sleep(every_s)


async def run_until_signalled(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run `main(stop)`; SIGTERM or SIGINT sets `stop`."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await main(stop)


def setup_logging(name: str) -> None:
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s {name} %(levelname)s %(message)s")
