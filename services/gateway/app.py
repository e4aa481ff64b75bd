"""The gateway: OpenAI-compatible endpoints, validated and tokenized here, dispatched to the
prefill instance with the shortest queue (and the least-loaded decode instance), the token
stream relayed back as SSE or one JSON. A client that goes away cancels its request."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import random
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from nats.aio.client import Client
from nats.aio.msg import Msg
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pydantic_settings import BaseSettings, SettingsConfigDict
from redis.asyncio import Redis

from services.gateway.openai_api import APIError, ChatRequest, CompletionRequest
from shared import subjects
from shared.bus import connect, parse, publish
from shared.engine.gguf_loader import read_gguf_meta
from shared.engine.tokenizer import TextTokenizer
from shared.messages import Cancel, PrefillRequest, RequestDone, Sampling, TokenChunk
from shared.state import Registry, Role, pick_decode, pick_prefill
from shared.telemetry import headers_for, setup_tracing
from shared.telemetry import shutdown as shutdown_tracing


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DS_")

    nats_url: str = "nats://127.0.0.1:4222"
    redis_url: str = "redis://127.0.0.1:6379"
    model: str = "smollm2-135m"
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    host: str = "127.0.0.1"
    port: int = 8000
    heartbeat_ttl_s: float = 2.0
    stall_timeout_s: float = 60.0  # no token for this long: the request fails
    run_dir: str | None = None  # traces go here as JSON lines (unless OTLP is configured)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("ds_requests", "requests by outcome", ["outcome"],
                                registry=self.registry)
        self.ttft = Histogram("ds_ttft_seconds", "time to first token", registry=self.registry)
        self.tpot = Histogram("ds_tpot_seconds", "time per output token after the first",
                              registry=self.registry,
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5))
        labels = ["instance", "role"]
        self.kv_bytes = Gauge("ds_kv_transfer_bytes", "KV bytes moved over UCX", labels,
                              registry=self.registry)
        self.kv_requests = Gauge("ds_kv_transfer_requests", "KV transfers over UCX", labels,
                                 registry=self.registry)
        self.free_blocks = Gauge("ds_kv_free_blocks", "free KV blocks", labels,
                                 registry=self.registry)
        self.total_blocks = Gauge("ds_kv_total_blocks", "KV blocks in the pool", labels,
                                  registry=self.registry)
        self.steps = Gauge("ds_engine_steps", "engine steps so far", labels,
                           registry=self.registry)
        self.step_seconds = Gauge("ds_engine_step_seconds", "seconds in engine steps", labels,
                                  registry=self.registry)
        self.outputs_seconds = Gauge("ds_engine_outputs_seconds",
                                     "seconds handling step outputs", labels,
                                     registry=self.registry)
        self.batched = Gauge("ds_engine_batched_requests",
                             "requests that got a token, summed over steps", labels,
                             registry=self.registry)


class Gateway:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        config, tokenizer_data = read_gguf_meta(settings.model)
        self.tokenizer = TextTokenizer(tokenizer_data)
        self.max_context = config.max_context
        self.metrics = Metrics()
        self.tracer = setup_tracing("gateway", settings.run_dir)
        # requests this gateway has sent and not yet seen prefilled / finished, per instance
        self.prefilling: collections.Counter[str] = collections.Counter()
        self.decoding: collections.Counter[str] = collections.Counter()
        self._cleanups: set[asyncio.Task[None]] = set()
        self.nc: Client
        self.redis: Redis
        self.registry: Registry

    async def start(self) -> None:
        self.nc = await connect(self.settings.nats_url, "gateway")
        self.redis = Redis.from_url(self.settings.redis_url)
        self.registry = Registry(self.redis, self.settings.heartbeat_ttl_s)

    async def stop(self) -> None:
        shutdown_tracing()
        await self.nc.drain()
        await self.redis.aclose()

    # -- requests --------------------------------------------------------------------

    def check_model(self, model: str) -> None:
        if model != self.settings.model:
            raise APIError(400, f"The model `{model}` does not exist; this server serves "
                                f"`{self.settings.model}`.", "model", "model_not_found")

    def sampling(self, req: CompletionRequest | ChatRequest, prompt_len: int,
                 max_tokens: int | None, logprobs: bool) -> Sampling:
        room = self.max_context - prompt_len
        if room < 1:
            raise APIError(400, f"This model's maximum context length is {self.max_context} "
                                f"tokens; the prompt has {prompt_len}.", "messages",
                           "context_length_exceeded")
        if max_tokens is not None and max_tokens > room:
            raise APIError(400, f"This model's maximum context length is {self.max_context} "
                                f"tokens; the prompt ({prompt_len}) plus max_tokens "
                                f"({max_tokens}) exceeds it.", "max_tokens",
                           "context_length_exceeded")
        return Sampling(max_tokens=max_tokens or room, temperature=req.temperature,
                        top_p=req.top_p, top_k=max(0, req.top_k),
                        seed=req.seed if req.seed is not None else random.getrandbits(62),
                        stop=req.stop_list, ignore_eos=req.ignore_eos, logprobs=logprobs)

    async def dispatch(self) -> tuple[str, str]:
        """(worker that takes the request, decode instance or "")."""
        if self.settings.mode == "colocated":
            worker = pick_prefill(await self.registry.instances("colocated"), self.decoding)
            if worker is None:
                raise APIError(503, "no colocated worker is available", kind="server_error")
            return worker.instance_id, ""
        prefill = pick_prefill(await self.registry.instances("prefill"), self.prefilling)
        decode = pick_decode(await self.registry.instances("decode"), self.decoding)
        if prefill is None or decode is None:
            raise APIError(503, "no prefill or decode instance is available",
                           kind="server_error")
        return prefill.instance_id, decode.instance_id

    async def generate(self, request_id: str, prompt_ids: list[int], sampling: Sampling,
                       target: tuple[str, str]) -> AsyncGenerator[TokenChunk, None]:
        """The request's token chunks until it finishes; an error chunk if it fails."""
        worker, decode = target
        chunks: asyncio.Queue[TokenChunk] = asyncio.Queue()

        async def on_chunk(msg: Msg) -> None:
            chunks.put_nowait(parse(msg, TokenChunk))

        sub = await self.nc.subscribe(subjects.tokens(request_id), cb=on_chunk)
        finished = False
        prefilling = bool(decode)
        self.prefilling[worker] += prefilling
        self.decoding[decode or worker] += 1
        await self._inflight(1, worker, decode)
        span = self.tracer.start_span("request", attributes={
            "request_id": request_id, "prompt_tokens": len(prompt_ids),
            "max_tokens": sampling.max_tokens, "prefill": worker, "decode": decode})
        outcome = "cancelled"
        arrival = time.time()
        first_at = last_at = 0.0
        tokens = 0
        try:
            await publish(self.nc, subjects.prefill(worker), PrefillRequest(
                request_id=request_id, prompt_ids=prompt_ids, sampling=sampling,
                decode_instance=decode, arrival_ts=arrival), headers=headers_for(span))
            async for chunk in self._relay(chunks, worker, decode):
                finished = chunk.finish_reason is not None or chunk.error is not None
                if chunk.token_ids:
                    last_at = time.time()
                    first_at = first_at or last_at
                    tokens += len(chunk.token_ids)
                if prefilling and (chunk.source == worker or finished):
                    self.prefilling[worker] -= 1
                    prefilling = False
                    await self._inflight(-1, worker)
                if finished:
                    outcome = chunk.error or chunk.finish_reason or ""
                yield chunk
                if finished:
                    return
        finally:
            span.set_attribute("outcome", outcome)
            span.end()
            self.prefilling[worker] -= prefilling
            self.decoding[decode or worker] -= 1
            done = RequestDone(
                arrival_ts=arrival, prompt_tokens=len(prompt_ids), output_tokens=tokens,
                ttft_s=first_at - arrival if first_at else None,
                tpot_s=(last_at - first_at) / (tokens - 1) if tokens > 1 else None,
                outcome=outcome)
            holders = [worker] if prefilling else []
            # its own task: when the client went away this generator is being cancelled, and
            # every await here would be cancelled too, losing the cancel and the counts
            task = asyncio.get_running_loop().create_task(self._after(
                request_id, sub, finished, [*holders, decode or worker], done))
            self._cleanups.add(task)
            task.add_done_callback(self._cleanups.discard)

    async def _after(self, request_id: str, sub: Any, finished: bool, holders: list[str],
                     done: RequestDone) -> None:
        """What follows a request: cancel it if the client went away, stop listening, count
        it out of its instances, and tell the profiler."""
        if not finished:
            await publish(self.nc, subjects.cancel(request_id), Cancel(request_id=request_id))
        await sub.unsubscribe()
        await self._inflight(-1, *holders)
        await publish(self.nc, subjects.REQUEST_EVENTS, done)

    async def _inflight(self, delta: int, *instances: str) -> None:
        """Count what this gateway has in flight per instance in Redis, where a draining
        instance looks before it exits (the heartbeats it dispatches on are stale)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for instance in instances:
                if instance:
                    pipe.incrby(subjects.inflight_key(instance), delta)
            await pipe.execute()

    async def _relay(self, chunks: asyncio.Queue[TokenChunk], worker: str,
                     decode: str) -> AsyncIterator[TokenChunk]:
        """Chunks as they come. The request fails when the instance serving it (the worker
        until the first token, then the decode instance) stops heartbeating, or when nothing
        arrives for stall_timeout_s: it never hangs."""
        last = time.monotonic()
        serving = worker
        while True:
            try:
                chunk = await asyncio.wait_for(chunks.get(), timeout=1.0)
            except TimeoutError:
                if not await self.redis.exists(subjects.instance_key(serving)):
                    yield TokenChunk(request_id="", error=f"instance {serving} stopped")
                    return
                if time.monotonic() - last > self.settings.stall_timeout_s:
                    yield TokenChunk(request_id="", error="no token for "
                                     f"{self.settings.stall_timeout_s:.0f}s")
                    return
                continue
            last = time.monotonic()
            if decode and chunk.source == worker:
                serving = decode
            yield chunk

    async def kv_metrics(self) -> None:
        m = self.metrics
        gauges = {m.kv_bytes: "kv_bytes", m.kv_requests: "kv_requests",
                  m.free_blocks: "free_blocks", m.total_blocks: "total_blocks",
                  m.steps: "steps", m.step_seconds: "step_seconds",
                  m.outputs_seconds: "outputs_seconds", m.batched: "batched"}
        for gauge in gauges:
            gauge.clear()  # instances that stopped heartbeating leave the figures
        roles: tuple[Role, ...] = ("prefill", "decode", "colocated")
        for role in roles:
            for info in await self.registry.instances(role):
                for gauge, field in gauges.items():
                    gauge.labels(info.instance_id, role).set(getattr(info, field))


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    gateway = Gateway(settings or GatewaySettings())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        yield
        await gateway.stop()

    app = FastAPI(title="distserve gateway", lifespan=lifespan)
    app.state.gateway = gateway

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        gateway.metrics.requests.labels("rejected" if e.status < 500 else "error").inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message = "the request body is not valid JSON"
        gateway.metrics.requests.labels("rejected").inc()
        return JSONResponse(APIError(400, f"{message}" + (f" ({where})" if where else ""),
                                     where).body(), status_code=400)

    from services.gateway.routes import add_routes

    add_routes(app, gateway)
    return app


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
