"""An open-loop load generator for any OpenAI-compatible server: each request is sent at its
arrival time whether or not earlier ones have finished, streams its answer, and is timed at
every chunk that carries text. Requests ask for exactly `max_tokens` tokens (`ignore_eos`, as
the paper's benchmark), so every system does the same work."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from distserve.bench.results import RequestRecord, RunResult
from distserve.bench.workload import BenchRequest


@dataclass(frozen=True)
class Target:
    url: str  # base URL, e.g. http://127.0.0.1:8000 (the /v1 routes are appended)
    model: str
    api_key: str | None = None
    timeout_s: float = 300.0  # a request still running after this counts as failed

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


async def served_model(url: str, api_key: str | None = None) -> str:
    """The first model the server lists at /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.get(f"{url.rstrip('/')}/v1/models", headers=headers)
        response.raise_for_status()
        data = response.json().get("data") or []
    if not data:
        raise RuntimeError(f"{url} lists no models at /v1/models")
    return str(data[0]["id"])


async def run_requests(target: Target, requests: Sequence[BenchRequest], rate: float,
                       on_done: Callable[[RequestRecord], None] | None = None) -> RunResult:
    """Send `requests` at their arrival times (open loop) and wait for all of them, under
    a `cache_salt` of the run's own (vLLM's extension, ours too): a workload's requests come
    again at every rate, and no run finds its prompts cached by the runs before it."""
    salt = uuid.uuid4().hex
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30),
                                 limits=limits) as client:
        start = time.perf_counter()

        async def one(request: BenchRequest) -> RequestRecord:
            record = await _send(client, target, request, start, salt)
            if on_done is not None:
                on_done(record)
            return record

        records = await asyncio.gather(*(one(r) for r in requests))
        duration = time.perf_counter() - start
    return RunResult(rate, list(records), duration)


async def _send(client: httpx.AsyncClient, target: Target, request: BenchRequest,
                start: float, salt: str) -> RequestRecord:
    record = RequestRecord(request.index, request.arrival_s, request.prompt_tokens,
                           request.max_tokens)
    await asyncio.sleep(max(0.0, request.arrival_s - (time.perf_counter() - start)))
    record.sent_s = time.perf_counter() - start
    body = {"model": target.model, "prompt": request.prompt, "max_tokens": request.max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}, "cache_salt": salt}
    try:
        async with asyncio.timeout(target.timeout_s):
            await _stream(client, target, body, record, start)
    except TimeoutError:
        record.error = f"timed out after {target.timeout_s:g}s"
    except httpx.HTTPError as e:
        record.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return record


async def _stream(client: httpx.AsyncClient, target: Target, body: dict[str, Any],
                  record: RequestRecord, start: float) -> None:
    url = f"{target.url.rstrip('/')}/v1/completions"
    async with client.stream("POST", url, json=body, headers=target.headers) as response:
        if response.status_code != 200:
            record.error = f"HTTP {response.status_code}: {_message(await response.aread())}"
            return
        chunks, usage, finished = 0, None, False
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                record.error = _message(data.encode())
                return
            record.request_id = record.request_id or str(event.get("id", "")) or None
            for choice in event.get("choices") or []:
                # a token whose text is empty (a special token, or a partial character held
                # back) still arrives: in the final chunk if not before
                if choice.get("text") or choice.get("finish_reason") is not None:
                    now = time.perf_counter() - start
                    if record.first_token_s is None:
                        record.first_token_s = now
                    record.last_token_s = now
                    chunks += 1
                finished = finished or choice.get("finish_reason") is not None
            usage = event.get("usage") or usage
        if not finished:
            record.error = "the stream ended before the request finished"
            return
        record.tokens = int(usage["completion_tokens"]) if usage else chunks
        details = (usage or {}).get("prompt_tokens_details") or {}
        record.cached_tokens = int(details.get("cached_tokens") or 0)
        if record.first_token_s is None:
            record.error = "no tokens"


def _message(body: bytes) -> str:
    """The message of an OpenAI-shaped error body, or the body itself."""
    try:
        error = json.loads(body).get("error")
        return str(error.get("message", error)) if isinstance(error, dict) else str(error)
    except (ValueError, AttributeError):
        return body.decode(errors="replace")[:200]
