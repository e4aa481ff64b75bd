"""HTTP routes: /v1/completions, /v1/chat/completions, /v1/responses (served as the chat
completion it amounts to; GET and DELETE /v1/responses/ID and GET .../input_items: those
kept), /v1/models[/ID], /health, /metrics.

A request is admitted (or gets 429) before anything else, tokenized off the event loop,
dispatched, and answered as one JSON or as SSE. A client that goes away, streaming or not,
cancels its request on every instance."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from redis.exceptions import RedisError
from starlette.types import Receive, Scope, Send

from services.gateway import openai_api as api
from services.gateway import responses, tool_calls
from services.gateway.gateway import Gateway, Target
from services.gateway.ledger import Booking, Ticket
from services.gateway.openai_api import (
    APIError,
    ChatRequest,
    CompletionRequest,
    ContextExceeded,
    ParamError,
)
from services.gateway.responses import ResponsesRequest, Shape
from services.gateway.stored import Conversation, Missing, ResponseStore, TooLong
from services.gateway.stream import GaveUp
from services.gateway.timing import RequestTiming
from services.gateway.tool_calls import Splitter
from shared.engine.tokenizer import ChatTemplateError
from shared.messages import Sampling, TokenChunk

log = logging.getLogger("gateway")
T = TypeVar("T")
DRESSED_ON_LOOP = 256  # logprob entries shown on the event loop; more go to a thread
HASHED_ON_LOOP = 8192  # prompt tokens hashed for dispatch on the event loop (~1 ms); more: a thread
MAX_SCORED = 1 << 20  # prompt tokens x (1 + top) one echo request scores (~30 MB of JSON)


class Call:
    """One choice of an admitted request (a request with n choices runs n, each a request of
    its own on the instances): what shapes its answer, and its timing."""

    def __init__(self, gateway: Gateway, chat: bool, target: Target, booking: Booking | None,
                 prompt_ids: list[int], sampling: Sampling, request_id: str,
                 index: int = 0, echo: str | None = None, generates: bool = True,
                 calls: str | None = None, parallel_calls: bool = True) -> None:
        self.gateway, self.chat, self.target, self.booking = gateway, chat, target, booking
        # tools offered: the answer's tool calls read from its text in the format `calls`
        # (tool_calls.call_format; streamed: held from where a call may begin);
        # `parallel_calls` False: the first call only
        self.splitter = None if calls is None else Splitter(parallel_calls, calls)
        self.prompt_ids, self.sampling = prompt_ids, sampling
        self.request_id, self.index = request_id, index
        self.timing = RequestTiming(len(prompt_ids))
        self.echo = echo  # the prompt's text, shown before the first tokens (then None)
        self.generates = generates  # False: the prompt scored only (its token left out)
        # prompt position p -> the logprob of token p + 1 and the likeliest there
        self.scores: dict[int, tuple[float, list[tuple[int, float]]]] = {}
        # the characters of the tokens given logprobs so far (text_offset), counted from
        # their bytes: a character split between tokens counts once it is whole
        self.chars = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        # generated tokens whose logprobs wait for their text: a worker holds text back
        # that may begin a stop string, and leaves a stop string out of the text; a token
        # is shown once the text shown reaches into it, and at a stop string's finish those
        # past the text are dropped. Each: (id, logprob, its top ones, where it begins in the
        # generated text)
        self.held: list[tuple[int, float, list[tuple[int, float]], int]] = []
        self.generated_from: int | None = None  # self.chars where the generated text begins
        # characters the tokenizer's decoder strips from the generated text's start (a
        # SentencePiece decoder's leading space where the prompt gives the output no
        # context, TextTokenizer.context_of; None: no token with text came yet)
        self.stripped: int | None = None
        self.text_shown = 0  # characters of generated text shown
        self.cached_tokens = 0  # the prompt's tokens its prefill found in the KV pool

    def chunks(self) -> AsyncIterator[TokenChunk]:
        return self.gateway.generate(self.request_id, self.target, self.booking,
                                     self.prompt_ids, self.sampling, self.timing)

    def take(self, chunk: TokenChunk) -> None:
        """Keep the prompt's scores a chunk carries, by position (a long prompt's come in
        parts; a request prefilled again sends them again), and how much of the prompt
        its prefill found in the KV pool (with the first token)."""
        self.cached_tokens = chunk.cached_tokens or self.cached_tokens
        tops = chunk.prompt_top_logprobs
        for i, logprob in enumerate(chunk.prompt_logprobs):
            self.scores.setdefault(chunk.prompt_from + i,
                                   (logprob, tops[i] if i < len(tops) else []))

    def pending(self) -> bool:
        """Whether the echo waits to be shown."""
        return self.echo is not None

    def show(self, chunk: TokenChunk) -> tuple[str, dict[str, Any] | None]:
        """A chunk's text and logprobs block as the client sees them: the first shown comes
        after the echoed prompt and its tokens' scores (taken from the chunks before)."""
        text, echoed, tokens = chunk.text, [], chunk.token_ids
        if not self.generates:
            text, tokens = "", []
        by_eos = self.ended_by_eos(chunk)
        if self.chat and by_eos:
            tokens = tokens[:-1]  # a chat's end of turn is not part of its message
        self.text_shown += len(text)
        echo = ""
        if self.echo is not None and (chunk.token_ids or chunk.finish_reason):
            echo, echoed, self.echo = self.echo, self.prompt_ids, None
        ended = chunk.finish_reason is not None or chunk.error is not None
        cut = chunk.finish_reason == "stop" and not by_eos  # at a stop string
        return echo + text, self.logprob_block(echoed, tokens, chunk.logprobs,
                                               chunk.top_logprobs, ended, cut, echo)

    def ended_by_eos(self, chunk: TokenChunk) -> bool:
        return chunk.finish_reason == "stop" and bool(chunk.token_ids) and \
            not self.sampling.ignore_eos and chunk.token_ids[-1] in self.gateway.tokenizer.eos_ids

    def work(self, chunk: TokenChunk) -> int:
        """How many tokens showing the chunk dresses (the echoed prompt's too)."""
        echoed = len(self.prompt_ids) if self.echo is not None else 0
        return (echoed + len(chunk.token_ids)) * (1 + self.sampling.top_logprobs) \
            if self.sampling.logprobs else 0

    def finish(self, reason: str | None) -> str | None:
        """Why the choice ended, as the client asked for it (nothing generated: length)."""
        return reason if self.generates or reason is None else "length"

    @property
    def output_tokens(self) -> int:
        return self.timing.output_tokens if self.generates else 0

    def logprob_block(self, echoed: list[int], tokens: list[int], logprobs: list[float],
                      tops: list[list[tuple[int, float]]], ended: bool = False,
                      cut: bool = False, echo: str = "") -> dict[str, Any] | None:
        """`echoed`: the prompt's tokens, shown first with their scores (None for the
        first: nothing precedes it), each at its place in `echo`, its text; `tokens`:
        generated, held until the text shown reaches them (`held`); `ended`: the last chunk,
        which shows the rest, but where it `cut` the text at a stop string, those past the
        text. None: nothing to show yet."""
        if not self.sampling.logprobs:
            return None
        asked = bool(self.sampling.top_logprobs)

        def dress(top: list[tuple[int, float]]) -> list[api.TokenLogprob] | None:
            return [self.token(c, v) for c, v in top] if asked else None

        shown: list[tuple[int, float | None, list[api.TokenLogprob] | None]] = []
        offsets: list[int] = []
        if echoed:  # position p scores token p + 1; the first has nothing before it
            missing: tuple[float | None, list[tuple[int, float]]] = (None, [])
            scored = [self.scores.get(p, missing) for p in range(len(echoed) - 1)]
            shown = [(echoed[0], None, None)] + [
                (t, logprob, dress(top)) for t, (logprob, top) in zip(echoed[1:], scored,
                                                                      strict=True)]
            self.chars += self._place(echoed, echo, offsets)
        if self.generated_from is None:
            self.generated_from = self.chars
        tokenizer = self.gateway.tokenizer
        for i, (token_id, logprob) in enumerate(zip(tokens, logprobs, strict=False)):
            self.held.append((token_id, logprob, tops[i] if i < len(tops) else [], self.chars))
            if tokenizer.in_text(token_id):  # the generated text skips the rest
                text = self._utf8.decode(tokenizer.token_piece(token_id)[1])
                if self.stripped is None and text:
                    context = tokenizer.context_of(self.prompt_ids)
                    before = len(tokenizer.decode(context))
                    self.stripped = int(text.startswith(" ") and not tokenizer.decode(
                        [*context, token_id])[before:].startswith(" "))
                    text = text[self.stripped:]
                self.chars += len(text)
        reached = self.generated_from + self.text_shown
        go = len(self.held) if ended and not cut else \
            next((i for i, h in enumerate(self.held) if h[3] >= reached), len(self.held))
        for token_id, logprob, top, at in self.held[:go]:
            shown.append((token_id, logprob, dress(top)))
            offsets.append(at)
        self.held = [] if ended else self.held[go:]
        if not shown and not ended:
            return None
        dressed = [self.token(t, lp) for t, lp, _ in shown]
        if self.chat:
            return api.chat_logprobs(dressed, [top or [] for _, _, top in shown]
                                     if asked else None)
        return api.completion_logprobs(dressed, [top for _, _, top in shown] if asked else None,
                                       offsets)

    def _place(self, echoed: list[int], echo: str, offsets: list[int]) -> int:
        """Each echoed token's offset (appended to `offsets`) and the characters they
        take, read along `echo`: it holds the special tokens the prompt's text spelled, but
        not one the tokenizer added (a BOS), nor the leading space a SentencePiece encoder
        adds and its decoder strips (the first token with text, at the echo's start, whose
        decoding alone lacks it); elsewhere its own characters count."""
        tokenizer, at, first = self.gateway.tokenizer, 0, True
        for token_id in echoed:
            offsets.append(self.chars + at)
            text = self._utf8.decode(tokenizer.token_piece(token_id)[1])
            if not tokenizer.in_text(token_id):
                if text and not echo.startswith(text, at):
                    text = ""  # added to the text as encoded, not written in it
            elif text and first:
                first = False
                if at == 0 and text.startswith(" ") and \
                        not tokenizer.decode([token_id]).startswith(" "):
                    text = text[1:]
            at += len(text)
        return at

    def token(self, token_id: int, logprob: float | None) -> api.TokenLogprob:
        text, piece = self.gateway.tokenizer.token_piece(token_id)
        return api.TokenLogprob(text, piece, logprob)


class Reply:
    """An admitted request's answer: its choices' calls (n for each prompt, prompt by
    prompt), its id (the first choice's request id, which finds that choice's trace) and its
    usage (each prompt counted once, as OpenAI does)."""

    def __init__(self, calls: list[Call], model: str, include_usage: bool, n: int = 1
                 ) -> None:
        self.calls, self.model, self.include_usage, self.n = calls, model, include_usage, n
        self.chat = calls[0].chat
        self.id = api.response_id(calls[0].request_id, self.chat)

    def usage(self) -> dict[str, Any]:
        firsts = self.calls[::self.n]
        return api.usage(sum(len(c.prompt_ids) for c in firsts),
                         sum(c.output_tokens for c in self.calls),
                         sum(c.cached_tokens for c in firsts))


def choice_ids(request_id: str, n: int) -> list[str]:
    """The request ids of n choices: the first is the request's own."""
    return [request_id] + [f"{request_id}c{i}" for i in range(1, n)]


def choice_seeds(seed: int, n: int) -> list[int]:
    """Each choice its own draws; the first choice's are a single choice's with this seed."""
    return [seed + i for i in range(n)]


def failed(chunk: TokenChunk) -> APIError:
    """A chunk's error as the client gets it: a 400 where the request asked what cannot be
    served, a 500 where the server failed it (counted as the request ended)."""
    if chunk.refused:
        return APIError(400, f"the request cannot be served: {chunk.error}", counted=True)
    return APIError(500, f"the request failed: {chunk.error}", kind="server_error",
                    counted=True)


async def collect(call: Call) -> dict[str, Any]:
    whole = TokenChunk(request_id=call.request_id)  # the chunks together
    try:
        async with contextlib.aclosing(call.chunks()) as chunks:  # type: ignore[type-var]
            async for chunk in chunks:
                if chunk.error:
                    raise failed(chunk)
                whole.text += chunk.text
                whole.token_ids += chunk.token_ids
                whole.logprobs += chunk.logprobs
                whole.top_logprobs += chunk.top_logprobs
                whole.finish_reason = chunk.finish_reason or whole.finish_reason
                call.take(chunk)
    except GaveUp as e:  # nothing live to move it to, or moved too often: a later try may do
        retry_after = str(call.gateway.settings.retry_after_s)
        raise APIError(503, f"the request failed: {e}", kind="server_error",
                       headers={"Retry-After": retry_after}, counted=True) from None
    text, logprobs = await shown(call, whole)
    finish = call.finish(whole.finish_reason)
    if call.splitter is not None:
        answer = call.splitter.whole(text)
        return api.choice(True, answer.content, tool_calls.finish_reason(finish, answer.calls),
                          logprobs, stream=False, index=call.index, tool_calls=answer.calls)
    return api.choice(call.chat, text, finish, logprobs, stream=False, index=call.index)


async def shown(call: Call, chunk: TokenChunk) -> tuple[str, dict[str, Any] | None]:
    """`call.show(chunk)`, off the event loop where it dresses many tokens (an echoed
    prompt's scores: a few thousand tokens, each with its top ones, take a fraction of a
    second that every other stream would wait)."""
    if call.work(chunk) < DRESSED_ON_LOOP:
        return call.show(chunk)
    return await asyncio.to_thread(call.show, chunk)


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


def error_chunk(message: str) -> dict[str, Any]:
    return api.error_body(f"the request failed: {message}", "server_error")


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
    """The streamed answer as server-sent events, ended by [DONE]."""
    async with contextlib.aclosing(chunk_events(reply)) as chunks:  # type: ignore[type-var]
        async for chunk in chunks:
            yield api.sse(chunk)
    yield api.sse("[DONE]")


async def chunk_events(reply: Reply) -> AsyncIterator[dict[str, Any]]:
    """The streamed answer's chunks (OpenAI's, completion or chat), as they come; a failure
    ends them with an error body."""
    base = api.envelope(reply.id, reply.model, reply.chat, stream=True)
    extra = {"usage": None} if reply.include_usage else {}
    if reply.chat:
        yield base | {"choices": [api.first_chat_chunk(c.index) for c in reply.calls]} | extra
    try:
        async with contextlib.aclosing(interleaved(reply.calls)) as chunks:
            async for call, chunk in chunks:
                call.take(chunk)
                if chunk.error:
                    yield failed(chunk).body()
                    return
                if chunk.text or chunk.finish_reason or (chunk.token_ids and (
                        call.sampling.logprobs or call.pending())):
                    text, logprobs = await shown(call, chunk)
                    finish = call.finish(chunk.finish_reason)
                    if call.splitter is not None:  # a call's text held to the end
                        text = call.splitter.feed(text)
                        if finish is not None:
                            answer = call.splitter.end()
                            text += answer.content or ""
                            if answer.calls:
                                # the calls, then the finish in a chunk of its own, as
                                # OpenAI streams them (clients read a finish first)
                                choice = api.choice(True, text, None, logprobs, stream=True,
                                                    index=call.index, tool_calls=answer.calls)
                                yield base | {"choices": [choice]} | extra
                                text, logprobs = "", None
                                finish = tool_calls.finish_reason(finish, answer.calls)
                    if not (text or logprobs or finish):
                        continue  # text a call holds; logprobs waiting for their text
                    choice = api.choice(call.chat, text, finish, logprobs, stream=True,
                                        index=call.index)
                    yield base | {"choices": [choice]} | extra
    except GaveUp as e:
        yield error_chunk(str(e))
        return
    if reply.include_usage:
        yield base | {"choices": [], "usage": reply.usage()}


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


def owner(request: Request) -> str:
    """Whom the request's responses belong to: its API key's (app.Door; stored.py)."""
    return str(getattr(request.state, "owner", ""))


def add_routes(app: FastAPI, gateway: Gateway) -> None:
    tokenizer = gateway.tokenizer
    # the format the model's calls are read in from its answers (its template's, where the
    # text keeps its tags), or None
    call_form = tool_calls.call_format(
        tokenizer.chat_template, tool_calls.OPEN in tokenizer.decode(
            tokenizer.encode(tool_calls.OPEN)))

    async def completion_ids(prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return await asyncio.to_thread(tokenizer.encode, prompt, True)
        if any(not 0 <= t < tokenizer.vocab_size for t in prompt):
            raise APIError(400, f"token ids must be in [0, {tokenizer.vocab_size})", "prompt")
        return list(prompt)

    async def chat_ids(req: ChatRequest) -> list[int]:
        messages = [m.for_template() for m in req.messages]
        tools = req.offered_tools
        if tools and call_form is None:
            raise APIError(400, "tools cannot be offered to this model: its chat template "
                                "does not show tools with a call format this server reads "
                                "(Hermes' <tool_call> blocks as Qwen 2.5 and 3 write them, "
                                "Llama 3.1's and 3.2's JSON); send tool_choice \"none\" or "
                                "no tools", "tools")

        def encode() -> list[int]:
            try:
                return tokenizer.encode(tokenizer.apply_chat_template(messages, tools))
            except ChatTemplateError as e:  # no template, or one refusing these messages
                raise APIError(400, str(e), "messages") from e

        return await asyncio.to_thread(encode)

    def admit(n: int) -> list[Ticket]:
        """A slot for each of a request's n choices, or none: 429 with Retry-After (over
        capacity now, or more than the instances live now run at once: more may come), 400
        where n is past a limit set for the server."""
        if n > (limit := gateway.inflight_limit()):
            if gateway.settings.max_inflight:  # a set limit: it will never fit
                raise APIError(400, f"{n} choices (n for each prompt) are more than this "
                                    f"server runs at once ({limit})", "n")
            raise APIError(429, f"{n} choices (n for each prompt) are more than the "  # yet
                                f"instances live now run at once ({limit}); retry after "
                                f"{gateway.settings.retry_after_s}s", kind="rate_limit_error",
                           code="rate_limit_exceeded",
                           headers={"Retry-After": str(gateway.settings.retry_after_s)})
        tickets: list[Ticket] = []
        try:
            for _ in range(n):
                tickets.append(gateway.admit())
        except BaseException:
            release(tickets)
            raise
        return tickets

    async def begin(req: CompletionRequest | ChatRequest) -> tuple[Reply, list[Ticket]]:
        """The request admitted, tokenized and dispatched: its reply to read, and the
        slots it holds until the reply is read (released here if it fails before)."""
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
            scored = sum(map(len, each)) * req.n * (1 + req.top_count) \
                if req.scores_prompt else 0
            if scored > MAX_SCORED:
                raise APIError(400, f"echo with logprobs would score {scored:,} prompt tokens "
                                    f"and their top ones, past the {MAX_SCORED:,} one request "
                                    "answers: fewer prompts or choices, or smaller logprobs",
                               "logprobs")
            echoes: list[str | None] = [None] * len(each)  # as their tokens read
            if isinstance(req, CompletionRequest) and req.echo:
                echoes = [p if isinstance(p, str) else
                          tokenizer.decode(ids, skip_special_tokens=False)
                          for p, ids in zip(prompts, each, strict=True)]
            request_ids = choice_ids(uuid.uuid4().hex, len(tickets))
            chat = isinstance(req, ChatRequest)
            # the format each choice's calls are read in (tools offered), and how many
            form = call_form if isinstance(req, ChatRequest) and req.offered_tools else None
            grammar = await gateway.grammar(req, form)
            parallel = req.parallel_tool_calls if isinstance(req, ChatRequest) else True
            calls: list[Call] = []
            seeds: list[int] = []
            salt = req.cache_salt or ""
            hashes = [gateway.affinity.hashes(ids, salt) if len(ids) <= HASHED_ON_LOOP else
                      await asyncio.to_thread(gateway.affinity.hashes, ids, salt)
                      for ids in each]
            for index, ticket in enumerate(tickets):  # each dispatched apart: they spread
                ids, echo = each[index // req.n], echoes[index // req.n]
                target = gateway.dispatch(ticket, hashes[index // req.n], len(ids))
                sampling = gateway.sampling(target, len(ids), req, grammar)
                seeds = seeds or choice_seeds(sampling.seed, req.n)  # each prompt's the same
                sampling.seed = seeds[index % req.n]
                calls.append(Call(gateway, chat, target, ticket.booking, ids, sampling,
                                  request_ids[index], index, echo, req.generates, form,
                                  parallel))
            return Reply(calls, req.model, req.include_usage, req.n), tickets
        except BaseException:
            release(tickets)
            raise

    async def serve(req: CompletionRequest | ChatRequest, request: Request) -> Any:
        reply, tickets = await begin(req)
        return await respond(reply, tickets, request, req.stream)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        return await serve(req, request)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request) -> Any:
        return await serve(req, request)

    async def kept(read: Callable[[ResponseStore], Awaitable[T]], response_id: str,
                   param: str | None = None) -> T:
        """What `read` reads of the responses kept: 404 for one not kept (400, as OpenAI
        answers, where a request's `param` names it), 503 while Redis cannot be read."""
        if gateway.responses is None:
            raise APIError(400 if param else 404, "responses are not kept on this server "
                           "(DS_RESPONSES_TTL_S=0): send the conversation so far as input "
                           "items", param)
        try:
            return await read(gateway.responses)
        except Missing as e:
            gone = e.args[0]
            why = f"with id '{gone}' not found." + (
                f" (The conversation of '{response_id}' goes back to it.)"
                if gone != response_id else "")
            if param is None:
                raise APIError(404, f"Response {why}") from None
            raise APIError(400, f"Previous response {why}", param,
                           "previous_response_not_found") from None
        except TooLong as e:
            raise APIError(400, str(e), param) from None
        except (RedisError, OSError) as e:  # a blip: a later try may do
            log.warning("the responses kept cannot be read: %s", e)
            raise APIError(503, "the responses kept cannot be read now: retry later",
                           kind="server_error",
                           headers={"Retry-After": str(gateway.settings.retry_after_s)}
                           ) from None

    async def latest_turns(req: ResponsesRequest, earlier: list[dict[str, Any]],
                           exceeded: ContextExceeded) -> ChatRequest:
        """`truncation: auto`: the chat of the conversation's latest turns that fit the
        context (`responses.latest_turns`); `exceeded` where not even its last turn does."""
        async def prompt_len(chat: ChatRequest) -> int:
            return len(await chat_ids(chat))

        try:
            fitted = await responses.latest_turns(req, earlier, exceeded.room, prompt_len)
        except ParamError as e:
            raise APIError(400, str(e), e.param) from None
        if fitted is None:
            raise exceeded
        return fitted

    async def begin_truncated(req: ResponsesRequest, earlier: list[dict[str, Any]],
                              exceeded: ContextExceeded, tries: int = 3
                              ) -> tuple[Reply, list[Ticket]]:
        """`begin` with the conversation's latest turns that fit; cut again where they went
        to an instance of a shorter context (another route: their prompt is another), a
        few times at most."""
        for _ in range(tries):
            try:
                return await begin(await latest_turns(req, earlier, exceeded))
            except ContextExceeded as shorter:
                if shorter.room >= exceeded.room:
                    raise
                exceeded = shorter
        raise exceeded

    @app.post("/v1/responses")
    async def respond_to(req: ResponsesRequest, request: Request) -> Any:
        chat, before = req.chat_request, req.previous_response_id
        earlier: Conversation | None = None
        if before is not None:
            gateway.check_model(req.model)  # before reading what it would go on from
            earlier = await kept(lambda store: store.conversation(before, owner=owner(request)),
                                 before, "previous_response_id")
            try:
                chat = req.chat_after(earlier.items)
            except ParamError as e:
                raise APIError(400, str(e), e.param) from None
            except ValidationError as e:  # kept by another version of the gateway
                raise APIError(400, f"the conversation of response '{before}' cannot be "
                               f"read: {e.errors()[0]['msg']}", "previous_response_id"
                               ) from None
        try:
            try:
                reply, tickets = await begin(chat)
            except ContextExceeded as e:
                if req.truncation != "auto":
                    raise
                reply, tickets = await begin_truncated(
                    req, earlier.items if earlier is not None else [], e)
        except APIError as e:  # told in the Responses API's words
            e.param, e.message = responses.in_its_words(e.param, e.message)
            raise
        store = gateway.responses if req.store else None
        shape = Shape(req, reply.calls[0].request_id, int(time.time()), store is not None)

        async def keep(response: dict[str, Any]) -> None:
            """The response kept with its input, for a previous_response_id to go on from;
            where Redis fails it says it was not (store: false)."""
            if store is None:
                return
            try:
                await store.put(response, req.input_items(), earlier, owner(request))
            except (RedisError, OSError) as e:
                log.warning("response %s not kept: %s", response["id"], e)
                response["store"] = False

        if req.stream:
            return AdmittedStream(responses.events(shape, chunk_events(reply), keep), tickets)
        answered = await respond(reply, tickets, request, stream=False)
        if isinstance(answered, Response):
            return answered
        await keep(response := shape.answer(answered))
        return response

    @app.get("/v1/responses/{response_id}")
    async def kept_response(response_id: str, request: Request) -> dict[str, Any]:
        return await kept(lambda store: store.get(response_id, owner(request)), response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(response_id: str, request: Request, order: str = "desc",
                          after: str | None = None, limit: int = 20) -> dict[str, Any]:
        """The items the response was answered from: its conversation's and its input."""
        asked = await kept(lambda store: store.conversation(response_id, answered=False,
                                                            owner=owner(request)),
                           response_id)
        try:
            return responses.item_list(asked.items, response_id, order, after, limit)
        except ParamError as e:
            raise APIError(400, str(e), e.param) from None

    @app.delete("/v1/responses/{response_id}")
    async def forget_response(response_id: str, request: Request) -> dict[str, Any]:
        await kept(lambda store: store.delete(response_id, owner(request)), response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    def model_card() -> dict[str, Any]:
        return {"id": gateway.served_model, "object": "model", "created": 0,
                "owned_by": "distserve"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        if not model:  # /v1/models/: no such route (the 404 that names them)
            raise HTTPException(404)
        if model != gateway.served_model:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"`{gateway.served_model}`.", "model", "model_not_found")
        return model_card()

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = bool(gateway.routes(gateway.stuck_pools()))  # a request can be served
        pools = {role: gateway.live(role) for role in gateway.roles}
        return JSONResponse({"status": "ok" if ok else "degraded",
                             "mode": gateway.settings.mode,
                             "instances": {role: len(pool) for role, pool in pools.items()},
                             "instance_ids": sorted(i.instance_id for pool in pools.values()
                                                    for i in pool),
                             # live, but sent nothing while others serve: their engine is
                             # stuck at one step or call
                             "stuck_ids": sorted(i for ids in gateway.stuck.values()
                                                 for i in ids)},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        gateway.metrics.instances(i for role in gateway.roles for i in gateway.live(role))
        gateway.metrics.inflight.set(gateway.ledger.admitted)
        return Response(generate_latest(gateway.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    # HEAD as GET, its body dropped by the server (a load balancer's health check): kept out
    # of the OpenAPI schema, which describes bodies
    for path, endpoint in (("/v1/models", models), ("/v1/models/{model:path}", model),
                           ("/health", health), ("/metrics", metrics)):
        app.add_api_route(path, endpoint, methods=["HEAD"], include_in_schema=False)
