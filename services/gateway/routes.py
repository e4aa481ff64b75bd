"""HTTP routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.gateway.app import Gateway, new_id, sse
from services.gateway.openai_api import (
    APIError,
    ChatRequest,
    CompletionRequest,
    chat_logprobs,
    completion_logprobs,
    envelope,
    usage,
)
from shared.messages import Sampling, TokenChunk
from shared.state import Role


class Call:
    """One request in flight: what is needed to shape its answer."""

    def __init__(self, gateway: Gateway, model: str, chat: bool, prompt_ids: list[int],
                 sampling: Sampling, include_usage: bool) -> None:
        self.gateway, self.model, self.chat = gateway, model, chat
        self.prompt_ids, self.sampling, self.include_usage = prompt_ids, sampling, include_usage
        self.id = new_id(chat)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.start = time.monotonic()
        self.first_at: float | None = None

    def record(self, chunk: TokenChunk) -> None:
        if chunk.token_ids and self.first_at is None:
            self.first_at = time.monotonic()
            self.gateway.metrics.ttft.observe(self.first_at - self.start)
        self.tokens += chunk.token_ids
        self.logprobs += chunk.logprobs

    def done(self, outcome: str) -> None:
        self.gateway.metrics.requests.labels(outcome).inc()
        if self.first_at is not None and len(self.tokens) > 1:
            self.gateway.metrics.tpot.observe(
                (time.monotonic() - self.first_at) / (len(self.tokens) - 1))

    def logprob_block(self, tokens: list[int], logprobs: list[float]) -> dict[str, Any] | None:
        if not self.sampling.logprobs:
            return None
        texts = [self.gateway.tokenizer.decode([t], skip_special_tokens=False) for t in tokens]
        build = chat_logprobs if self.chat else completion_logprobs
        return build(texts, logprobs[: len(texts)])

    def choice(self, text: str, finish: str | None, logprobs: dict[str, Any] | None,
               stream: bool) -> dict[str, Any]:
        if self.chat:
            key = "delta" if stream else "message"
            body: dict[str, Any] = {"role": "assistant", "content": text} if not stream \
                else ({"content": text} if text else {})
            return {"index": 0, key: body, "logprobs": logprobs, "finish_reason": finish}
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def usage(self) -> dict[str, int]:
        return usage(len(self.prompt_ids), len(self.tokens))


async def answer(call: Call) -> Any:
    gateway = call.gateway
    target = await gateway.dispatch()
    stream = gateway.generate(call.id.split("-", 1)[1], call.prompt_ids, call.sampling, target)
    text, finish = "", None
    async with contextlib.aclosing(stream) as chunks:
        async for chunk in chunks:
            if chunk.error:
                call.done("error")
                raise APIError(503, f"the request failed: {chunk.error}", kind="server_error")
            call.record(chunk)
            text += chunk.text
            finish = chunk.finish_reason or finish
    call.done("ok")
    body = envelope(call.id, call.model, call.chat, stream=False)
    body["choices"] = [call.choice(text, finish, call.logprob_block(call.tokens, call.logprobs),
                                   stream=False)]
    body["usage"] = call.usage()
    return body


async def stream_events(call: Call, target: tuple[str, str]) -> AsyncIterator[str]:
    gateway = call.gateway
    base = envelope(call.id, call.model, call.chat, stream=True)
    extra = {"usage": None} if call.include_usage else {}
    if call.chat:
        yield sse(base | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None}]} | extra)
    stream = gateway.generate(call.id.split("-", 1)[1], call.prompt_ids, call.sampling, target)
    async with contextlib.aclosing(stream) as chunks:
        async for chunk in chunks:
            if chunk.error:
                call.done("error")
                yield sse({"error": {"message": f"the request failed: {chunk.error}",
                                     "type": "server_error", "param": None, "code": None}})
                yield sse("[DONE]")
                return
            call.record(chunk)
            if chunk.text or chunk.finish_reason or (chunk.token_ids and call.sampling.logprobs):
                logprobs = call.logprob_block(chunk.token_ids, chunk.logprobs)
                choice = call.choice(chunk.text, chunk.finish_reason, logprobs, stream=True)
                yield sse(base | {"choices": [choice]} | extra)
    call.done("ok")
    if call.include_usage:
        yield sse(base | {"choices": [], "usage": call.usage()})
    yield sse("[DONE]")


async def respond(call: Call, stream: bool) -> Any:
    if not stream:
        return await answer(call)
    target = await call.gateway.dispatch()  # before the 200: no instance is still a 503
    return StreamingResponse(stream_events(call, target), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def add_routes(app: FastAPI, gateway: Gateway) -> None:
    tokenizer = gateway.tokenizer

    @app.get("/health")
    async def health() -> JSONResponse:
        roles: tuple[Role, ...] = (("colocated",) if gateway.settings.mode == "colocated"
                                   else ("prefill", "decode"))
        live = {role: len(await gateway.registry.instances(role)) for role in roles}
        ok = all(live.values())
        return JSONResponse({"status": "ok" if ok else "degraded",
                             "mode": gateway.settings.mode, "instances": live},
                            status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": gateway.settings.model, "object": "model",
                                            "created": 0, "owned_by": "distserve"}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        await gateway.kv_metrics()
        return Response(generate_latest(gateway.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> Any:
        gateway.check_model(req.model)
        prompt = req.prompt[0] if isinstance(req.prompt, list) and isinstance(
            req.prompt[0], str) else req.prompt
        if isinstance(prompt, str):
            ids = tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
            if any(not 0 <= t < tokenizer.vocab_size for t in ids):
                raise APIError(400, f"token ids must be in [0, {tokenizer.vocab_size})",
                               "prompt")
        if not ids:
            raise APIError(400, "the prompt is empty", "prompt")
        sampling = gateway.sampling(req, len(ids), req.max_tokens, req.logprobs is not None)
        call = Call(gateway, req.model, False, ids, sampling, req.include_usage)
        return await respond(call, req.stream)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest) -> Any:
        gateway.check_model(req.model)
        messages = [{"role": m.role, "content": m.text} for m in req.messages]
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
        sampling = gateway.sampling(req, len(ids), req.max_completion_tokens or req.max_tokens,
                                    req.logprobs)
        call = Call(gateway, req.model, True, ids, sampling, req.include_usage)
        return await respond(call, req.stream)
