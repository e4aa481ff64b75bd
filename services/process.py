"""What every service process shares, without the engine (torch): the workers' settings,
logging, signals, a clean exit on settings a process cannot start with, and the control
services' (planner, profiler) base. The gateway and the control services need nothing more
of services/; the workers' runtime (services/runtime.py) adds the engine."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

from nats.aio.client import Client
from nats.aio.msg import Msg
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from redis.asyncio import Redis

from shared import subjects
from shared.bus import connect
from shared.engine.config import EngineConfig, Role
from shared.state import redis_client

T = TypeVar("T")
log = logging.getLogger(__name__)


class WorkerSettings(BaseSettings):
    """A worker's configuration: DS_* environment variables (the launcher sets them)."""

    model_config = SettingsConfigDict(env_prefix="DS_")

    instance_id: str = ""
    alive_file: str = ""  # touched every second while alive (the supervisor sets it)
    nats_url: str = "nats://127.0.0.1:4222"
    redis_url: str = "redis://127.0.0.1:6379"
    host: str = "127.0.0.1"  # address others reach this instance's KV listener on
    kv_port: int = 0  # the KV listener's port (0: any free port)
    model: str = "smollm2-135m"
    device: str = "auto"
    dtype: str = "auto"
    weights: str = "auto"  # "int8" / "int4": quantized matrices (a decode instance's choice)
    threads: int = 0
    tp: int = 1  # tensor-parallel ranks a stage of this instance (processes it starts) ...
    pp: int = 1  # ... and its pipeline stages
    kv_cache_mb: int = 256
    block_size: int = 16
    max_batch_tokens: int = 512  # prefill: L_m; colocated: tokens per prefill step / chunk
    max_running: int = 64
    chunked_prefill: bool = False
    prefix_caching: bool = True  # a prompt's start found in the KV pool is not computed again
    heartbeat_s: float = 0.5
    heartbeat_ttl_s: float = 2.0
    kv_lease_s: float = 30.0  # prefill frees parked KV once its decode instance is silent
    kv_max_hold_s: float = 600.0  # ... or once parked this long, whatever the decode side
    kv_retention_s: float = 5.0  # prefill keeps imported KV this long more, for a failover
    kv_pull_timeout_s: float = 10.0  # decode abandons a pull that takes longer
    drain_timeout_s: float = 120.0  # a drain that has not finished by then exits anyway
    # an engine step (or a call on the engine thread) running longer is hung (0: never; a
    # 512-token prompt takes ~1.4 s on one core of the 2-vCPU hosts here): the worker stops
    # showing alive, and its supervisor kills it DS_HANG_TIMEOUT_S later; one that no
    # supervisor watches (no alive file: docker-compose, or DS_HANG_TIMEOUT_S=0) exits with
    # code 70 (3, DRAINED, where it was asked to leave). Keep it above
    # DS_COLLECTIVE_TIMEOUT_S (600 s), which a tp/pp instance's first step may wait out
    # for a rank still loading its weights.
    step_timeout_s: float = Field(default=900.0, ge=0)
    # a gateway whose lease key is read absent this long is gone: its requests are cancelled
    gateway_lease_s: float = Field(default=10.0, gt=0)
    # a KV announcement is acknowledged by its decode instance within this, or sent again
    # (these times; the same settings as the gateway's dispatch)
    dispatch_ack_s: float = Field(default=2.0, gt=0)
    dispatch_tries: int = Field(default=3, ge=1)
    run_dir: str | None = None  # traces go here as JSON lines (unless OTLP is configured)

    def engine_config(self, role: Role) -> EngineConfig:
        config = EngineConfig(model=self.model, device=self.device, dtype=self.dtype,
                              weights=self.weights, threads=self.threads, tp=self.tp, pp=self.pp,
                              kv_cache_bytes=self.kv_cache_mb << 20)
        return config.with_scheduler(role=role, block_size=self.block_size,
                                     max_batch_tokens=self.max_batch_tokens,
                                     max_running=self.max_running,
                                     chunked_prefill=self.chunked_prefill,
                                     prefix_caching=self.prefix_caching)

    def named(self, role: str) -> WorkerSettings:
        if self.instance_id:
            return self
        return self.model_copy(update={"instance_id": f"{role}-{uuid.uuid4().hex[:6]}"})


class ControlService:
    """A control service (profiler, planner): connected to NATS and Redis, subscribed to its
    one subject, and marked ready in Redis while it serves (the launcher waits for the mark)."""

    name: str
    subject: str
    nc: Client
    redis: Redis

    def __init__(self, nats_url: str, redis_url: str) -> None:
        self.nats_url, self.redis_url = nats_url, redis_url

    async def on_message(self, msg: Msg) -> None:
        raise NotImplementedError

    async def serve(self, stop: asyncio.Event) -> None:
        """Until `stop`; the connections are open."""
        await stop.wait()

    async def run(self, stop: asyncio.Event) -> None:
        self.nc = await connect(self.nats_url, self.name)
        self.redis = redis_client(self.redis_url)
        await self.nc.subscribe(self.subject, cb=self.on_message)
        await self.nc.flush()
        await self.redis.set(subjects.ready_key(self.name), time.time())
        try:
            await self.serve(stop)
        finally:
            await self.redis.delete(subjects.ready_key(self.name))
            await self.nc.drain()
            await self.redis.aclose()


async def run_until_signalled(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run `main(stop)`; SIGTERM or SIGINT sets `stop`, a second one exits at once."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def signalled() -> None:
        if stop.is_set():
            log.warning("second signal: exiting without draining")
            os._exit(1)  # at once: not even waiting for threads
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signalled)
    await main(stop)


def setup_logging(name: str) -> None:
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s {name} %(levelname)s %(message)s")


def built_or_exit(name: str, build: Callable[[], T]) -> T:
    """`build()`, or, where the settings name a model or a value the process cannot start
    with (an unknown model, a checkpoint it cannot read, a dtype the device lacks), that reason
    in the log and exit code 2: a message, not a traceback."""
    try:
        return build()
    except ValueError as e:  # ModelNotFoundError, CheckpointError, bad settings
        log.error("%s cannot start: %s", name, e)
        sys.exit(2)
