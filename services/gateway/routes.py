"""HTTP routes: /v1/completions, /v1/chat/completions, /v1/models[/ID], /health, /metrics.

A request is admitted (or gets 429) before anything else, tokenized off the event loop,
dispatched, and answered as one JSON or as SSE. A client that goes away, streaming or not,
cancels its request on every instance."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
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
    """One choice of an admitted request (a request with n choices runs n, each a request of
    its own on the instances): what shapes its answer, and its timing."""

    def __init__(self, gateway: Gateway, chat: bool, target: Target, booking: Booking | None,
                 prompt_ids: list[int], sampling: Sampling, request_id: str,
                 index: int = 0, echo: str | None = None, generates: bool = True) -> None:
        self.gateway, self.chat, self.target, self.booking = gateway, chat, target, booking
        self.prompt_ids, self.sampling = prompt_ids, sampling
        self.request_id, self.index = request_id, index
        self.timing = RequestTiming(len(prompt_ids))
        self.offset = 0  # the characters of the tokens whose logprobs were given so far
        self.echo = echo  # the prompt's text, shown before the first tokens (then None)
        self.generates = generates  # False: the prompt scored only (its token left out)
        self.prompt_scores: tuple[list[float], list[list[tuple[int, float]]]] | None = None

    def chunks(self) -> AsyncIterator[TokenChunk]:
        return self.gateway.generate(self.request_id, self.target, self.booking,
                                     self.prompt_ids, self.sampling, self.timing)

    def pending(self) -> bool:
        """Whether the echo waits to be shown."""
        return self.echo is not None

    def show(self, chunk: TokenChunk) -> tuple[str, dict[str, Any] | None]:
        """A chunk's text and logprobs block as the client sees them: the first shown comes
        after the echoed prompt and its tokens' scores (which come with the first token: the
        first copy heard is kept, a request prefilled again sends them again)."""
        if chunk.prompt_logprobs and self.prompt_scores is None:
            self.prompt_scores = (chunk.prompt_logprobs, chunk.prompt_top_logprobs)
        text, echoed, tokens = chunk.text, [], chunk.token_ids
        if not self.generates:
            text, tokens = "", []
        if self.echo is not None and (chunk.token_ids or chunk.finish_reason):
            text, echoed, self.echo = self.echo + text, self.prompt_ids, None
        return text, self.logprob_block(echoed, tokens, chunk.logprobs, chunk.top_logprobs)

    def finish(self, reason: str | None) -> str | None:
        """Why the choice ended, as the client asked for it (nothing generated: length)."""
        return reason if self.generates or reason is None else "length"

    @property
    def output_tokens(self) -> int:
        return self.timing.output_tokens if self.generates else 0

    def logprob_block(self, echoed: list[int], tokens: list[int], logprobs: list[float],
                      tops: list[list[tuple[int, float]]]) -> dict[str, Any] | None:
        """`echoed`: the prompt's tokens, shown first with their scores (None for the
        first: nothing precedes it)."""
        if not self.sampling.logprobs:
            return None
        chosen = [self.token(t, lp) for t, lp in zip(tokens, logprobs, strict=False)]
        top = None
        if self.sampling.top_logprobs:  # (a position without them, were one lost: none)
            top = [[self.token(t, lp) for t, lp in top] for top in tops[: len(chosen)]]
            top += [[] for _ in range(len(chosen) - len(top))]
        if self.chat:
            return api.chat_logprobs(chosen, top)
        shown_tops: list[list[api.TokenLogprob] | None] | None = list(top) \
            if top is not None else None
        if echoed:
            scores, prompt_tops = self.prompt_scores or ([], [])
            prompt = [self.token(t, scores[i - 1] if 0 < i <= len(scores) else None)
                      for i, t in enumerate(echoed)]
            chosen = prompt + chosen
            if shown_tops is not None:
                shown_tops = [None] + [[self.token(t, lp) for t, lp in top]
                                       for top in prompt_tops[: len(echoed) - 1]] \
                    + [[] for _ in range(len(echoed) - len(prompt_tops) - 1)] + shown_tops
        block = api.completion_logprobs(chosen, shown_tops, self.offset)
        self.offset += sum(len(t.text) for t in chosen)
        return block

    def token(self, token_id: int, logprob: float | None) -> api.TokenLogprob:
        tokenizer = self.gateway.tokenizer
        return api.TokenLogprob(tokenizer.decode([token_id], skip_special_tokens=False),
                                tokenizer.token_bytes(token_id), logprob)


class Reply:
    """An admitted request's answer: its choices' calls (n for each prompt, prompt by
    prompt), its id (the first choice's request id, which finds that choice's trace) and its
    usage (each prompt counted once, as OpenAI does)."""

    def __init__(self, calls: list[Call], model: str, include_usage: bool, n: int = 1
                 ) -> None:
        self.calls, self.model, self.include_usage, self.n = calls, model, include_usage, n
        self.chat = calls[0].chat
        self.id = api.response_id(calls[0].request_id, self.chat)

    def usage(self) -> dict[str, int]:
        return api.usage(sum(len(c.prompt_ids) for c in self.calls[::self.n]),
                         sum(c.output_tokens for c in self.calls))


def choice_ids(request_id: str, n: int) -> list[str]:
    """The request ids of n choices: the first is the request's own."""
    return [request_id] + [f"{request_id}c{i}" for i in range(1, n)]


def choice_seeds(seed: int, n: int) -> list[int]:
    """Each choice its own draws; the first choice's are a single choice's with this seed."""
    return [seed + i for i in range(n)]


def failed(chunk_error: str) -> APIError:
    return APIError(500, f"the request failed: {chunk_error}", kind="server_error")


async def collect(call: Call) -> dict[str, Any]:
    whole = TokenChunk(request_id=call.request_id)  # the chunks together
    try:
        async with contextlib.aclosing(call.chunks()) as chunks:  # type: ignore[type-var]
            async for chunk in chunks:
                if chunk.error:
                    raise failed(chunk.error)
                whole.text += chunk.text
                whole.token_ids += chunk.token_ids
                whole.logprobs += chunk.logprobs
                whole.top_logprobs += chunk.top_logprobs
                whole.finish_reason = chunk.finish_reason or whole.finish_reason
                if chunk.prompt_logprobs and not whole.prompt_logprobs:
                    whole.prompt_logprobs = chunk.prompt_logprobs
                    whole.prompt_top_logprobs = chunk.prompt_top_logprobs
    except GaveUp as e:
        raise APIError(503, f"the request failed: {e}", kind="server_error") from None
    text, logprobs = call.show(whole)
    return api.choice(call.chat, text, call.finish(whole.finish_reason), logprobs,
                      stream=False, index=call.index)


async def all_of(calls: list[Call]) -> list[dict[str, Any]]:
    """Every choice collected at once; the first to fail cancels the others (on their
    instances too) and is the answer."""
    tasks = [asyncio.ensure_future(collect(call)) for call in calls]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def answer(reply: Reply) -> dict[str, Any]:
    body = api.envelope(reply.id, reply.model, reply.chat, stream=False)
    body["choices"] = await all_of(reply.calls)
    body["usage"] = reply.usage()
    return body


async def answer_unless_gone(reply: Reply, request: Request) -> dict[str, Any] | Response:
    """The answer; if the client disconnects first, the request is cancelled (FastAPI does
    not cancel a non-streaming handler whose client went away) and nobody reads the reply."""
    answering = asyncio.ensure_future(answer(reply))
    watching = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait([answering, watching], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not answering.done():
            answering.cancel()  # the generators' cleanup cancels it on the workers
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


async def interleaved(calls: list[Call]) -> AsyncGenerator[tuple[Call, TokenChunk], None]:
    """The choices' chunks as they come, each with its call. One choice alone is read
    directly; several are read each by a task of its own, cancelled (on their instances
    too) when the stream ends early. GaveUp as soon as one choice gives up."""
    if len(calls) == 1:
        async with contextlib.aclosing(calls[0].chunks()) as chunks:  # type: ignore[type-var]
            async for chunk in chunks:
                yield calls[0], chunk
        return
    queue: asyncio.Queue[tuple[Call, TokenChunk | Exception | None]] = asyncio.Queue()

    async def read(call: Call) -> None:
        try:
            async with contextlib.aclosing(call.chunks()) as chunks:  # type: ignore[type-var]
                async for chunk in chunks:
                    queue.put_nowait((call, chunk))
        except Exception as e:  # GaveUp, or a fault: the stream ends with it
            queue.put_nowait((call, e))
        else:
            queue.put_nowait((call, None))

    tasks = [asyncio.ensure_future(read(call)) for call in calls]
    try:
        running = len(tasks)
        while running:
            call, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield call, item
    finally:
        for task in tasks:  # their generators' cleanup runs in their own tasks: a client
            task.cancel()   # gone away cancels this one's awaits


async def stream_events(reply: Reply) -> AsyncIterator[str]:
    base = api.envelope(reply.id, reply.model, reply.chat, stream=True)
    extra = {"usage": None} if reply.include_usage else {}
    if reply.chat:
        yield api.sse(base | {"choices": [api.first_chat_chunk(c.index) for c in reply.calls]}
                      | extra)
    try:
        async with contextlib.aclosing(interleaved(reply.calls)) as chunks:
            async for call, chunk in chunks:
                if chunk.error:
                    yield error_event(chunk.error)
                    yield api.sse("[DONE]")
                    return
                if chunk.text or chunk.finish_reason or (chunk.token_ids and (
                        call.sampling.logprobs or call.pending())):
                    text, logprobs = call.show(chunk)
                    choice = api.choice(call.chat, text, call.finish(chunk.finish_reason),
                                        logprobs, stream=True, index=call.index)
                    yield api.sse(base | {"choices": [choice]} | extra)
    except GaveUp as e:
        yield error_event(str(e))
        yield api.sse("[DONE]")
        return
    if reply.include_usage:
        yield api.sse(base | {"choices": [], "usage": reply.usage()})
    yield api.sse("[DONE]")


class AdmittedStream(StreamingResponse):
    """An SSE response that gives its admission slots back however it ends, even when the
    client left before the first byte and the body never started."""

    def __init__(self, content: AsyncIterator[str], tickets: list[Ticket]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.tickets = tickets

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            release(self.tickets)


def release(tickets: list[Ticket]) -> None:
    for ticket in tickets:
        ticket.release()


async def respond(reply: Reply, tickets: list[Ticket], request: Request, stream: bool) -> Any:
    if stream:
        return AdmittedStream(stream_events(reply), tickets)
    try:
        return await answer_unless_gone(reply, request)
    finally:
        release(tickets)


def add_routes(app: FastAPI, gateway: Gateway) -> None:
    tokenizer = gateway.tokenizer

    async def completion_ids(prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return await asyncio.to_thread(tokenizer.encode, prompt, True)
        if any(not 0 <= t < tokenizer.vocab_size for t in prompt):
            raise APIError(400, f"token ids must be in [0, {tokenizer.vocab_size})", "prompt")
        return list(prompt)

    async def chat_ids(req: ChatRequest) -> list[int]:
        messages = [m.for_template() for m in req.messages]

        def encode() -> list[int]:
            try:
                return tokenizer.encode(tokenizer.apply_chat_template(messages))
            except ChatTemplateError as e:  # no template, or one refusing these messages
                raise APIError(400, str(e), "messages") from e

        return await asyncio.to_thread(encode)

    def admit(n: int) -> list[Ticket]:
        """A slot for each of a request's n choices, or none (429, or 400 where n is more
        than this server ever runs at once)."""
        if n > (limit := gateway.inflight_limit()):
            raise APIError(400, f"{n} choices (n for each prompt) are more than this server "
                                f"runs at once ({limit})", "n")
        tickets: list[Ticket] = []
        try:
            for _ in range(n):
                tickets.append(gateway.admit())
        except BaseException:
            release(tickets)
            raise
        return tickets

    async def serve(req: CompletionRequest | ChatRequest, request: Request) -> Any:
        gateway.check_model(req.model)
        prompts = req.prompts if isinstance(req, CompletionRequest) else [""]
        tickets = admit(len(prompts) * req.n)
        try:
            if isinstance(req, ChatRequest):
                each = [await chat_ids(req)]
            else:
                each = [await completion_ids(prompt) for prompt in prompts]
            if not all(each):
                raise APIError(400, "the prompt is empty", "prompt")
            request_ids = choice_ids(uuid.uuid4().hex, len(tickets))
            calls: list[Call] = []
            seeds: list[int] = []
            for index, ticket in enumerate(tickets):  # each dispatched apart: they spread
                ids, prompt = each[index // req.n], prompts[index // req.n]
                target = gateway.dispatch(ticket)
                sampling = gateway.sampling(target, len(ids), req)
                seeds = seeds or choice_seeds(sampling.seed, req.n)  # each prompt's the same
                sampling.seed = seeds[index % req.n]
                echo = None
                if isinstance(req, CompletionRequest) and req.echo:
                    echo = prompt if isinstance(prompt, str) else tokenizer.decode(ids)
                calls.append(Call(gateway, isinstance(req, ChatRequest), target,
                                  ticket.booking, ids, sampling, request_ids[index], index,
                                  echo, req.generates))
            reply = Reply(calls, req.model, req.include_usage, req.n)
            return await respond(reply, tickets, request, req.stream)
        except BaseException:
            release(tickets)
            raise

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        return await serve(req, request)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request) -> Any:
        return await serve(req, request)

    def model_card() -> dict[str, Any]:
        return {"id": gateway.served_model, "object": "model", "created": 0,
                "owned_by": "distserve"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        if model != gateway.served_model:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"`{gateway.served_model}`.", "model", "model_not_found")
        return model_card()

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
