"""HTTP routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

A request is admitted (or gets 429) before anything else, tokenized off the event loop,
dispatched, and answered as one JSON or as SSE. A client that goes away, streaming or not,
cancels its request on every instance."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import Receive, Scope, Send

from services.gateway import openai_api as api
from services.gateway.gateway import Gateway, Target
from services.gateway.ledger import Booking, Ticket
from services.gateway.openai_api import APIError, ChatRequest, CompletionRequest
from services.gateway.stream import GaveUp
from services.gateway.timing import RequestTiming
from shared.engine.tokenizer import ChatTemplateError
from shared.messages import Sampling, TokenChunk


class Call:
    """One admitted request: what shapes its answer, and its timing."""

    def __init__(self, gateway: Gateway, model: str, chat: bool, target: Target,
                 booking: Booking | None, prompt_ids: list[int], sampling: Sampling,
                 include_usage: bool) -> None:
        self.gateway, self.model, self.chat, self.target = gateway, model, chat, target
        self.booking = booking
        self.prompt_ids, self.sampling, self.include_usage = prompt_ids, sampling, include_usage
        self.request_id = uuid.uuid4().hex
        self.id = api.response_id(self.request_id, chat)
        self.timing = RequestTiming(len(prompt_ids))
        self.logprobs: list[float] = []

    def chunks(self) -> AsyncIterator[TokenChunk]:
        return self.gateway.generate(self.request_id, self.target, self.booking,
                                     self.prompt_ids, self.sampling, self.timing)

    def logprob_block(self, tokens: list[int], logprobs: list[float]) -> dict[str, Any] | None:
        if not self.sampling.logprobs:
            return None
        texts = [self.gateway.tokenizer.decode([t], skip_special_tokens=False) for t in tokens]
        build = api.chat_logprobs if self.chat else api.completion_logprobs
        return build(texts, logprobs[: len(texts)])

    def usage(self) -> dict[str, int]:
        return api.usage(len(self.prompt_ids), self.timing.output_tokens)


def failed(chunk_error: str) -> APIError:
    return APIError(500, f"the request failed: {chunk_error}", kind="server_error")


async def answer(call: Call) -> dict[str, Any]:
    text, finish, tokens, logprobs = "", None, [], []
    try:
        async with contextlib.aclosing(call.chunks()) as chunks:  # type: ignore[type-var]
            async for chunk in chunks:
                if chunk.error:
                    raise failed(chunk.error)
                text += chunk.text
                tokens += chunk.token_ids
                logprobs += chunk.logprobs
                finish = chunk.finish_reason or finish
    except GaveUp as e:
        raise APIError(503, f"the request failed: {e}", kind="server_error") from None
    body = api.envelope(call.id, call.model, call.chat, stream=False)
    body["choices"] = [api.choice(call.chat, text, finish, call.logprob_block(tokens, logprobs),
                                  stream=False)]
    body["usage"] = call.usage()
    return body


async def answer_unless_gone(call: Call, request: Request) -> dict[str, Any] | Response:
    """The answer; if the client disconnects first, the request is cancelled (FastAPI does
    not cancel a non-streaming handler whose client went away) and nobody reads the reply."""
    answering = asyncio.ensure_future(answer(call))
    watching = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait([answering, watching], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not answering.done():
            answering.cancel()  # the generator's cleanup cancels it on the workers
            with contextlib.suppress(asyncio.CancelledError):
                await answering
    if answering.cancelled():
        return Response(status_code=499)  # nginx's "client closed request"; nobody sees it
    return answering.result()


async def until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def error_event(message: str) -> str:
    return api.sse(api.error_body(f"the request failed: {message}", "server_error"))


async def stream_events(call: Call) -> AsyncIterator[str]:
    base = api.envelope(call.id, call.model, call.chat, stream=True)
    extra = {"usage": None} if call.include_usage else {}
    if call.chat:
        yield api.sse(base | {"choices": [api.first_chat_chunk()]} | extra)
    try:
        async with contextlib.aclosing(call.chunks()) as chunks:  # type: ignore[type-var]
            async for chunk in chunks:
                if chunk.error:
                    yield error_event(chunk.error)
                    yield api.sse("[DONE]")
                    return
                if chunk.text or chunk.finish_reason or (chunk.token_ids and
                                                         call.sampling.logprobs):
                    logprobs = call.logprob_block(chunk.token_ids, chunk.logprobs)
                    choice = api.choice(call.chat, chunk.text, chunk.finish_reason, logprobs,
                                        stream=True)
                    yield api.sse(base | {"choices": [choice]} | extra)
    except GaveUp as e:
        yield error_event(str(e))
        yield api.sse("[DONE]")
        return
    if call.include_usage:
        yield api.sse(base | {"choices": [], "usage": call.usage()})
    yield api.sse("[DONE]")


class AdmittedStream(StreamingResponse):
    """An SSE response that gives its admission slot back however it ends, even when the
    client left before the first byte and the body never started."""

    def __init__(self, content: AsyncIterator[str], ticket: Ticket) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.ticket = ticket

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.ticket.release()


async def respond(call: Call, ticket: Ticket, request: Request, stream: bool) -> Any:
    if stream:
        return AdmittedStream(stream_events(call), ticket)
    try:
        return await answer_unless_gone(call, request)
    finally:
        ticket.release()


def add_routes(app: FastAPI, gateway: Gateway) -> None:
    tokenizer = gateway.tokenizer

    async def completion_ids(req: CompletionRequest) -> list[int]:
        prompt = req.text_or_ids
        if isinstance(prompt, str):
            return await asyncio.to_thread(tokenizer.encode, prompt, True)
        if any(not 0 <= t < tokenizer.vocab_size for t in prompt):
            raise APIError(400, f"token ids must be in [0, {tokenizer.vocab_size})", "prompt")
        return list(prompt)

    async def chat_ids(req: ChatRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.text} for m in req.messages]

        def encode() -> list[int]:
            try:
                return tokenizer.encode(tokenizer.apply_chat_template(messages))
            except ChatTemplateError as e:  # no template, or one refusing these messages
                raise APIError(400, str(e), "messages") from e

        return await asyncio.to_thread(encode)

    async def serve(req: CompletionRequest | ChatRequest, request: Request) -> Any:
        gateway.check_model(req.model)
        ticket = gateway.admit()
        try:
            chat = isinstance(req, ChatRequest)
            ids = await (chat_ids(req) if chat else completion_ids(req))  # type: ignore[arg-type]
            if not ids:
                raise APIError(400, "the prompt is empty", "prompt")
            target = gateway.dispatch(ticket)
            sampling = gateway.sampling(target, len(ids), req)
            call = Call(gateway, req.model, chat, target, ticket.booking, ids, sampling,
                        req.include_usage)
            return await respond(call, ticket, request, req.stream)
        except BaseException:
            ticket.release()
            raise

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        return await serve(req, request)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request) -> Any:
        return await serve(req, request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": gateway.served_model, "object": "model",
                                            "created": 0, "owned_by": "distserve"}]}

    @app.get("/health")
    async def health() -> JSONResponse:
        pools = gateway.live_pools()
        ok = bool(gateway.routes(pools))  # a request can be served
        return JSONResponse({"status": "ok" if ok else "degraded",
                             "mode": gateway.settings.mode,
                             "instances": {role: len(pool) for role, pool in pools.items()},
                             "instance_ids": sorted(i.instance_id for pool in pools.values()
                                                    for i in pool)},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        gateway.metrics.instances(i for role in gateway.roles for i in gateway.live(role))
        gateway.metrics.inflight.set(gateway.ledger.admitted)
        return Response(generate_latest(gateway.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)
