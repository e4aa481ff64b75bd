"""OpenAI's Responses API (`POST /v1/responses`, what the openai client's `responses.create`
sends), served as the chat completion it amounts to, and pure (no I/O): the request's model,
the chat request it becomes, and the answer and its stream of events shaped from the chat
answer's.

Served: `input` as text or as messages (text parts), `instructions`, `max_output_tokens`,
`temperature`, `top_p`, `stream`, `metadata`, logprobs (`include:
["message.output_text.logprobs"]`, with `top_logprobs` of the likeliest), `text.format` (JSON,
or JSON valid against a schema: the chat's response_format). Refused with a 400 that says so
(UNSERVED): what needs state kept on the server (`previous_response_id`, `conversation`, a
stored `prompt`, `background`; nothing is stored, and `store` reads back false), and tools."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from services.gateway.openai_api import (
    Int,
    JSONModel,
    ParamError,
    RequestBody,
    Temperature,
    Text,
    TopP,
    text_only,
)
from shared.engine.request import MAX_TOP_LOGPROBS

TEXT_PARTS = {"input_text", "output_text"}  # an input message's parts read as text
LOGPROBS = "message.output_text.logprobs"  # what `include` asks logprobs with
# the chat request's parameters an error may name -> the response's they came from
CHAT_PARAMS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
               "messages": "input", "response_format": "text.format"}


class InputText(JSONModel):
    type: Literal["input_text", "output_text"]
    text: Text


class InputMessage(JSONModel):
    """One message of `input`: an earlier answer (assistant) or what is asked."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[InputText]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else \
            "".join(p.text for p in self.content)


class TextFormat(JSONModel):
    """What the answer is held to: the chat's response_format, its json_schema's fields
    beside the type."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: Text = Field(default="response", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("a json_schema text.format needs its schema")
        return self

    def chat(self) -> dict[str, Any]:
        """The chat's response_format."""
        if self.type != "json_schema":
            return {"type": self.type}
        schema = {key: value for key, value in self.shown().items() if key != "type"}
        return {"type": "json_schema", "json_schema": schema}

    def shown(self) -> dict[str, Any]:
        """As the response shows it back."""
        return self.model_dump(by_alias=True, exclude_none=True) \
            if self.type == "json_schema" else {"type": self.type}


class TextConfig(JSONModel):
    format: TextFormat = TextFormat()


# text, or messages: a mistake inside a message is told as that, not as "not a string"
Input = Annotated[Annotated[Text, Tag("str")] | Annotated[list[InputMessage], Tag("list")],
                  Discriminator(lambda v: "str" if isinstance(v, str) else "list")]


class ResponsesRequest(RequestBody):
    model: Text
    input: Input
    instructions: Text | None = None  # a system message before the input
    max_output_tokens: Int | None = Field(default=None, ge=1)
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    stream: bool = False
    store: bool = True  # accepted; nothing is stored (the answer says store: false)
    metadata: dict[str, Text] | None = None  # shown back in the answer
    parallel_tool_calls: bool = True
    text: TextConfig = TextConfig()
    include: list[Text] | None = None  # LOGPROBS: the text's tokens with their logprobs
    top_logprobs: Int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # refused where they ask for what this server does not do (UNSERVED)
    previous_response_id: Text | None = None
    conversation: Text | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    background: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _messages_of_text(cls, items: Any) -> Any:
        """An empty input, items other than messages (a function call's output, a reasoning
        item) and parts other than text get a 400 that says so."""
        if items in ("", []):
            raise ValueError("the input is empty")
        for item in items if isinstance(items, list) else []:
            if not isinstance(item, dict):
                continue
            if (kind := item.get("type", "message")) != "message":
                raise ValueError(f"input items of type '{str(kind)[:64]}' are not served: "
                                 "send messages (text)")
            text_only(item.get("content"), TEXT_PARTS)
        return items

    @model_validator(mode="after")
    def _served(self) -> ResponsesRequest:
        for param, asks, why in UNSERVED:
            if asks(self):
                raise ParamError(param, why)
        return self

    @property
    def logprobs(self) -> bool:
        """Whether the text's tokens come with their logprobs: asked by `include`, as OpenAI
        reads it (`top_logprobs` says how many of the likeliest go with each)."""
        return LOGPROBS in (self.include or [])

    def chat(self) -> dict[str, Any]:
        """The chat completion request this asks for (a streamed one counts its usage)."""
        messages = [{"role": "system", "content": self.instructions}] \
            if self.instructions else []
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            messages += [{"role": m.role, "content": m.text} for m in self.input]
        body: dict[str, Any] = {"model": self.model, "messages": messages,
                                "temperature": self.temperature, "top_p": self.top_p,
                                "stream": self.stream}
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.logprobs:
            body |= {"logprobs": True, "top_logprobs": self.top_logprobs or 0}
        if self.text.format.type != "text":
            body["response_format"] = self.text.format.chat()
        return body


# what the server would have to keep, or do, to serve: (the parameter, whether a request
# asks it, what to send instead)
UNSERVED: tuple[tuple[str, Callable[[ResponsesRequest], bool], str], ...] = (
    ("previous_response_id", lambda r: r.previous_response_id is not None,
     "responses are not stored on this server: send the conversation so far as input "
     "messages"),
    ("conversation", lambda r: r.conversation is not None,
     "conversations are not stored on this server: send the conversation so far as input "
     "messages"),
    ("prompt", lambda r: r.prompt is not None,
     "stored prompts are not served: send the prompt's text as instructions or input"),
    ("background", lambda r: r.background,
     "background responses are not served (nothing is stored to poll): leave background out"),
    ("tools", lambda r: bool(r.tools),
     "tools are not served on /v1/responses; /v1/chat/completions offers them"),
    ("tool_choice", lambda r: r.tool_choice not in (None, "auto", "none"),
     "no tools are served on /v1/responses: send tool_choice auto or none"),
)


Status = Literal["in_progress", "completed", "incomplete", "failed"]


@dataclass
class Shape:
    """How one response's objects read: its ids (`resp_` and `msg_` before the request's
    own id, which finds its trace), the request's parameters shown back, when it began
    (Unix seconds)."""

    request: ResponsesRequest
    request_id: str
    created_at: int

    @property
    def id(self) -> str:
        return "resp_" + self.request_id

    @property
    def item_id(self) -> str:
        return "msg_" + self.request_id

    @property
    def where(self) -> dict[str, Any]:
        """Where a stream's text events are: the one message, its one part."""
        return {"item_id": self.item_id, "output_index": 0, "content_index": 0}

    def response(self, status: Status, output: list[dict[str, Any]],
                 usage: dict[str, Any] | None = None, error: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
        r = self.request
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "model": r.model, "output": output, "parallel_tool_calls": r.parallel_tool_calls,
            "previous_response_id": None, "store": False, "temperature": r.temperature,
            "text": {"format": r.text.format.shown()}, "tool_choice": r.tool_choice or "auto",
            "tools": [], "top_p": r.top_p, "top_logprobs": r.top_logprobs or 0,
            "truncation": "disabled",
            "usage": None if usage is None else self.usage(usage),
            "metadata": r.metadata or {}}

    def message(self, text: str | None, status: Status,
                logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The answer's message; `text` None: not begun (no content part yet)."""
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant",
                "content": [] if text is None else [text_part(text, logprobs)]}

    @staticmethod
    def usage(chat: dict[str, Any]) -> dict[str, Any]:
        """A chat answer's usage as a response counts it."""
        return {"input_tokens": chat["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": chat["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": chat["total_tokens"]}

    def answer(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The response to return, from the chat completion's answer."""
        first = chat["choices"][0]
        status = ended(first["finish_reason"])
        message = self.message(first["message"]["content"] or "", status, tokens_of(first))
        return self.response(status, [message], chat["usage"])


def text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def tokens_of(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat choice's (or chunk's) tokens with their logprobs, as a response shows them:
    the same entries (token, logprob, bytes, top_logprobs)."""
    return list((choice.get("logprobs") or {}).get("content") or [])


def ended(finish_reason: str | None) -> Status:
    """A response cut by its token limit is incomplete, as OpenAI says of it."""
    return "incomplete" if finish_reason == "length" else "completed"


async def events(shape: Shape, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """The streamed response, as server-sent events (each named, with its type and a
    sequence number), from the chat answer's chunks (`routes.chunk_events`, closed here
    however this ends): the response created and in progress, the message and its text part
    added, each piece of text, then the text, part, message and response done; a chat error
    ends it as response.failed."""
    event, where = Events(), shape.where
    yield event("response.created", response=shape.response("in_progress", []))
    yield event("response.in_progress", response=shape.response("in_progress", []))
    yield event("response.output_item.added", output_index=0,
                item=shape.message(None, "in_progress"))
    yield event("response.content_part.added", part=text_part(""), **where)
    pieces: list[str] = []
    shown: list[dict[str, Any]] = []  # the tokens' logprobs, each with its text's delta
    waiting: list[dict[str, Any]] = []  # those of tokens whose text has not come yet
    finish, usage = None, None
    async with contextlib.aclosing(chunks):  # type: ignore[type-var]
        async for chunk in chunks:
            if "error" in chunk:  # the request's own doing, or the server's
                error = {"code": "invalid_prompt" if chunk["error"]["type"] ==
                         "invalid_request_error" else "server_error",
                         "message": chunk["error"]["message"]}
                yield event("response.failed", response=shape.response("failed", [],
                                                                       error=error))
                return
            for choice in chunk["choices"]:
                waiting += tokens_of(choice)
                if piece := choice["delta"].get("content"):
                    pieces.append(piece)
                    yield event("response.output_text.delta", delta=piece, logprobs=waiting,
                                **where)
                    shown, waiting = shown + waiting, []
                finish = choice["finish_reason"] or finish
            usage = chunk.get("usage") or usage
    # the end repeats every token's logprobs four times: thousands, each with its top ones,
    # take a fraction of a second that every other stream would wait (routes.shown)
    end = (shape, event, "".join(pieces), ended(finish), usage, shown + waiting)
    for done in await asyncio.to_thread(closing, *end) if shown or waiting else closing(*end):
        yield done


class Events:
    """Names and numbers a stream's events."""

    def __init__(self) -> None:
        self.numbers = itertools.count()

    def __call__(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": next(self.numbers)} | fields
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"


def closing(shape: Shape, event: Events, text: str, status: Status,
            usage: dict[str, Any] | None, logprobs: list[dict[str, Any]]) -> list[str]:
    """The events that end a stream whose text is all there: the text, its part, the
    message and the response done."""
    where, message = shape.where, shape.message(text, status, logprobs)
    return [event("response.output_text.done", text=text, logprobs=logprobs, **where),
            event("response.content_part.done", part=text_part(text, logprobs), **where),
            event("response.output_item.done", output_index=0, item=message),
            event(f"response.{status}", response=shape.response(status, [message], usage))]
