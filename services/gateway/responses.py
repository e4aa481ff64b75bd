"""OpenAI's Responses API (`POST /v1/responses`, what the openai client's `responses.create`
sends), served as the chat completion it amounts to, and pure (no I/O): the request's model,
the chat request it becomes, and the answer and its stream of events shaped from the chat
answer's.

Served: `input` as text or as items: messages (text parts), and an agent's function calls
and their outputs sent back; `instructions`, `max_output_tokens`, `temperature`, `top_p`,
`stream`, `metadata`, logprobs (`include: ["message.output_text.logprobs"]`, with
`top_logprobs` of the likeliest), `text.format` (JSON, or JSON valid against a schema: the
chat's response_format), function `tools` with `tool_choice` and `parallel_tool_calls` (the
chat's tools: the calls an answer makes are output items of their own), and
`previous_response_id` (the gateway keeps responses: stored.py): the conversation that
response ended, its input and answer, goes before this input; a kept response's items are
listed a page at a time (item_list). Refused with a 400 that says so
(UNSERVED): `conversation` objects, a stored `prompt`, `background`, and tools other than
functions (OpenAI's hosted ones: web search, file search...)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from services.gateway.openai_api import (
    MAX_TOOLS,
    ChatRequest,
    FunctionSpec,
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


def in_its_words(param: str | None, message: str) -> tuple[str | None, str]:
    """An error the chat request met, told in the Responses API's words."""
    return (CHAT_PARAMS.get(param or "", param),
            message.replace("max_tokens", "max_output_tokens").replace(
                "response_format", "text.format"))


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


class FunctionCallItem(JSONModel):
    """A call the model made, sent back in the input (an earlier response's output item)."""

    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text

    def chat(self) -> dict[str, Any]:
        """The call as a chat's assistant message carries it."""
        return {"id": self.call_id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class FunctionCallOutputItem(JSONModel):
    """What a call gave back, for the model to read: a chat's tool message."""

    type: Literal["function_call_output"]
    call_id: Text
    output: Text | list[InputText]

    @field_validator("output", mode="before")
    @classmethod
    def _text_only(cls, output: Any) -> Any:
        return text_only(output, TEXT_PARTS)

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else \
            "".join(p.text for p in self.output)


ITEMS = {"message", "function_call", "function_call_output"}  # what `input` may hold


def _item_kind(item: Any) -> Any:
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)


Item = Annotated[Annotated[InputMessage, Tag("message")]
                 | Annotated[FunctionCallItem, Tag("function_call")]
                 | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                 Discriminator(_item_kind)]


class FunctionTool(FunctionSpec):
    """A function the model may call, in the Responses API's form (the chat's spec beside
    its type; what else OpenAI's tools say, such as `defer_loading`, is left out)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    strict: bool | None = None  # the arguments held to parameters' keywords, every one

    def chat(self) -> dict[str, Any]:
        """The chat's tool."""
        return {"type": "function",
                "function": self.model_dump(exclude={"type"}, exclude_none=True)}


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


# text, or items: a mistake inside a message is told as that, not as "not a string"
Input = Annotated[Annotated[Text, Tag("str")] | Annotated[list[Item], Tag("list")],
                  Discriminator(lambda v: "str" if isinstance(v, str) else "list")]


class ResponsesRequest(RequestBody):
    model: Text
    input: Input
    instructions: Text | None = None  # a system message before the input
    max_output_tokens: Int | None = Field(default=None, ge=1)
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    stream: bool = False
    store: bool = True  # kept for a later previous_response_id (where the server keeps any)
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
    tools: list[FunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    cache_salt: Text | None = None  # extension (vLLM's): the chat's (openai_api._Common)
    # "auto": a conversation past the context is answered from its latest turns that fit
    truncation: Literal["auto", "disabled"] = "disabled"
    _chat: ChatRequest | None = PrivateAttr(default=None)  # the chat request this asks for

    @field_validator("input", mode="before")
    @classmethod
    def _messages_of_text(cls, items: Any) -> Any:
        """An empty input, items other than messages and function calls with their outputs
        (a reasoning item, a hosted tool's call) and parts other than text get a 400 that
        says so."""
        if items in ("", []):
            raise ValueError("the input is empty")
        for item in items if isinstance(items, list) else []:
            if not isinstance(item, dict):
                continue
            kind = item.get("type", "message")
            if not isinstance(kind, str) or kind not in ITEMS:
                raise ValueError(f"input items of type '{str(kind)[:64]}' are not served: "
                                 "send messages (text), function calls and their outputs")
            if kind == "message":
                text_only(item.get("content"), TEXT_PARTS)
        return items

    @field_validator("tools", mode="before")
    @classmethod
    def _functions(cls, tools: Any) -> Any:
        """Hosted tools (web search, file search, a computer, MCP servers...) are OpenAI's
        to run: a 400 that says so."""
        for tool in tools if isinstance(tools, list) else []:
            if isinstance(tool, dict) and "type" in tool and \
                    (kind := tool["type"]) != "function":
                raise ParamError("tools", f"tools of type '{str(kind)[:64]}' are not served: "
                                 "this server offers function tools (type function)")
        return tools

    @model_validator(mode="after")
    def _served(self) -> ResponsesRequest:
        for param, asks, why in UNSERVED:
            if asks(self):
                raise ParamError(param, why)
        # what the chat refuses (a tool_choice naming no tool offered) is refused here, and a
        # tool_choice the chat cannot take (chat_tool_choice) as chat() builds it
        self._chat = chat_request(self.chat())
        return self

    @property
    def chat_request(self) -> ChatRequest:
        """The chat completion request this asks for, as the chat route reads it."""
        assert self._chat is not None  # read by the validator
        return self._chat

    def chat_after(self, earlier: list[dict[str, Any]]) -> ChatRequest:
        """The chat completion request this asks for where `earlier` items (a conversation
        kept: `input_items`' and answers') go before its input. ParamError where the chat
        refuses it."""
        return chat_request(self.chat(ITEMS_ADAPTER.validate_python(earlier)))

    def truncated(self, earlier: list[dict[str, Any]], start: int) -> ChatRequest:
        """The chat completion request of the conversation's items (the `earlier` ones, then
        the input's) from item `start` on (`turn_starts`: where a turn begins), the
        instructions before them, and the system and developer messages of the items left
        out (instructions too). ParamError where the chat refuses it."""
        items = [*earlier, *self.input_items()]
        rest = [item for item in items[:start] if item.get("type", "message") == "message"
                and item.get("role") in ("system", "developer")] + items[start:]
        return chat_request(self.model_copy(
            update={"input": ITEMS_ADAPTER.validate_python(rest)}).chat())

    def input_items(self) -> list[dict[str, Any]]:
        """The input as items (text: one user message), as a conversation is kept."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user",
                     "content": [{"type": "input_text", "text": self.input}]}]
        return [item.model_dump(by_alias=True) for item in self.input]

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        """tool_choice as the chat takes it: a function named is {"type": "function",
        "function": {"name": ...}} there. ParamError for a choice of another kind (allowed
        tools, a hosted tool)."""
        choice = self.tool_choice
        if choice is None or choice in ("auto", "none", "required"):
            return choice
        if isinstance(choice, dict) and choice.get("type") == "function" and \
                isinstance(name := choice.get("name"), str):
            return {"type": "function", "function": {"name": name}}
        raise ParamError("tool_choice", 'tool_choice takes "auto", "none", "required" or '
                         '{"type": "function", "name": ...}')

    @property
    def logprobs(self) -> bool:
        """Whether the text's tokens come with their logprobs: asked by `include`, as OpenAI
        reads it (`top_logprobs` says how many of the likeliest go with each)."""
        return LOGPROBS in (self.include or [])

    def chat(self, earlier: list[Item] | None = None) -> dict[str, Any]:
        """The chat completion request this asks for, the `earlier` items of a conversation
        kept before its input (the instructions go first: only this request's are read, as
        OpenAI reads them); a streamed one counts its usage."""
        messages: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] \
            if self.instructions else []
        items = (earlier or []) + (self.input if isinstance(self.input, list) else [])
        for item in items:
            if isinstance(item, InputMessage):
                messages.append({"role": item.role, "content": item.text})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id,
                                 "content": item.text})
            else:  # a call: its turn's, with the text and calls before it in that turn
                if not messages or messages[-1]["role"] != "assistant":
                    messages.append({"role": "assistant", "content": None})
                messages[-1].setdefault("tool_calls", []).append(item.chat())
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        body: dict[str, Any] = {"model": self.model, "messages": messages,
                                "temperature": self.temperature, "top_p": self.top_p,
                                "stream": self.stream}
        if self.tools:
            body |= {"tools": [tool.chat() for tool in self.tools],
                     "parallel_tool_calls": self.parallel_tool_calls}
        if self.tool_choice is not None:
            body["tool_choice"] = self.chat_tool_choice()
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.logprobs:
            body |= {"logprobs": True, "top_logprobs": self.top_logprobs or 0}
        if self.text.format.type != "text":
            body["response_format"] = self.text.format.chat()
        if self.cache_salt is not None:
            body["cache_salt"] = self.cache_salt
        return body


ITEMS_ADAPTER = TypeAdapter(list[Item])


def turn_starts(items: list[dict[str, Any]]) -> list[int]:
    """Where a conversation of `items` (as kept: dicts) may be cut for `truncation: auto`:
    at each user message but the first item, so that what is kept starts with a turn of
    its own (no tool output without its call) and keeps the last user message."""
    return [i for i, item in enumerate(items) if i and item.get("type", "message") ==
            "message" and item.get("role") == "user"]


async def latest_turns(request: ResponsesRequest, earlier: list[dict[str, Any]], room: int,
                       prompt_len: Callable[[ChatRequest], Awaitable[int]]
                       ) -> ChatRequest | None:
    """`truncation: auto`, as OpenAI reads it: the chat of the conversation (the
    `earlier` items, then the input's) from the first turn on whose prompt
    (`prompt_len`: its tokens) fits `room` tokens, its earlier turns dropped and the
    instructions kept; found by bisection over the turns' starts (a prompt from a later
    turn is shorter). None where not even the last turn fits alone."""
    if room < 1:  # the completion alone takes the context: no cut would do
        return None
    starts = turn_starts([*earlier, *request.input_items()])
    fitted, low, high = None, 0, len(starts) - 1
    while low <= high:
        middle = (low + high) // 2
        chat = request.truncated(earlier, starts[middle])
        if await prompt_len(chat) <= room:
            fitted, high = chat, middle - 1
        else:
            low = middle + 1
    return fitted


def chat_request(body: dict[str, Any]) -> ChatRequest:
    """The chat completion request `body` is; ParamError, in the Responses API's words,
    where the chat refuses it."""
    try:
        return ChatRequest.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        refused = first.get("ctx", {}).get("error")
        param = refused.param if isinstance(refused, ParamError) else \
            ".".join(str(part) for part in first["loc"][:1])
        raise ParamError(*in_its_words(param, str(first["msg"]).removeprefix(
            "Value error, "))) from None  # type: ignore[arg-type]


# what the server would have to keep, or do, to serve: (the parameter, whether a request
# asks it, what to send instead)
UNSERVED: tuple[tuple[str, Callable[[ResponsesRequest], bool], str], ...] = (
    ("conversation", lambda r: r.conversation is not None,
     "conversation objects are not kept on this server: send previous_response_id, or the "
     "conversation so far as input items"),
    ("prompt", lambda r: r.prompt is not None,
     "stored prompts are not served: send the prompt's text as instructions or input"),
    ("background", lambda r: r.background,
     "background responses are not served (nothing is stored to poll): leave background out"),
)


Status = Literal["in_progress", "completed", "incomplete", "failed"]


@dataclass
class Shape:
    """How one response's objects read: its ids (`resp_`, `msg_` and a call's `fc_` before
    the request's own id, which finds its trace), the request's parameters shown back, when
    it began (Unix seconds)."""

    request: ResponsesRequest
    request_id: str
    created_at: int
    stored: bool = False  # kept for a later previous_response_id

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
            "previous_response_id": r.previous_response_id, "store": self.stored,
            "temperature": r.temperature,
            "text": {"format": r.text.format.shown()}, "tool_choice": r.tool_choice or "auto",
            "tools": [tool.model_dump(exclude_none=True) for tool in r.tools or []],
            "top_p": r.top_p, "top_logprobs": r.top_logprobs or 0,
            "truncation": r.truncation,
            "usage": None if usage is None else self.usage(usage),
            "metadata": r.metadata or {}}

    def message(self, text: str | None, status: Status,
                logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The answer's message; `text` None: not begun (no content part yet)."""
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant",
                "content": [] if text is None else [text_part(text, logprobs)]}

    def call(self, call: dict[str, Any], index: int, status: Status = "completed"
             ) -> dict[str, Any]:
        """The answer's `index`th call (a chat's tool call) as an output item of its own;
        in progress: its arguments not given yet."""
        function = call["function"]
        return {"type": "function_call", "id": f"fc_{self.request_id}_{index}",
                "call_id": call["id"], "name": function["name"],
                "arguments": function["arguments"] if status != "in_progress" else "",
                "status": status}

    @staticmethod
    def usage(chat: dict[str, Any]) -> dict[str, Any]:
        """A chat answer's usage as a response counts it."""
        cached = chat.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        return {"input_tokens": chat["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                "output_tokens": chat["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": chat["total_tokens"]}

    def answer(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The response to return, from the chat completion's answer: its text a message
        (none where the answer is calls alone), then each call an item."""
        first = chat["choices"][0]
        status, said = ended(first["finish_reason"]), first["message"]
        text, calls, tokens = said["content"] or "", said.get("tool_calls") or [], \
            tokens_of(first)
        output = [self.message(text, status, tokens_before(tokens, text) if calls else tokens)
                  ] if text or not calls else []
        output += [self.call(call, i, status) for i, call in enumerate(calls)]
        return self.response(status, output, chat["usage"])


def text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def tokens_of(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat choice's (or chunk's) tokens with their logprobs, as a response shows them:
    the same entries (token, logprob, bytes, top_logprobs)."""
    return list((choice.get("logprobs") or {}).get("content") or [])


MOST_LISTED = 100  # input items one page lists


def item_list(items: list[dict[str, Any]], response_id: str, order: str = "desc",
              after: str | None = None, limit: int = 20) -> dict[str, Any]:
    """A page of the items a response was answered from (`GET .../input_items`), as OpenAI
    lists them: each with an id (its own, or one from its place), its content as parts, in
    `order` (of the conversation: "asc"; newest first: "desc"), from the one after `after`,
    `limit` of them. ParamError for an order, limit or `after` that cannot be."""
    if order not in ("asc", "desc"):
        raise ParamError("order", 'order is "asc" or "desc"')
    if not 1 <= limit <= MOST_LISTED:
        raise ParamError("limit", f"limit is from 1 to {MOST_LISTED}")
    listed = [listed_item(item, f"item_{i}_{response_id.removeprefix('resp_')}")
              for i, item in enumerate(items)]
    if order == "desc":
        listed.reverse()
    ids = [item["id"] for item in listed]
    if after is not None and after not in ids:
        raise ParamError("after", f"no input item of this response has the id {after!r}")
    start = 0 if after is None else ids.index(after) + 1
    page = listed[start:start + limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": start + limit < len(listed)}


def listed_item(item: dict[str, Any], default_id: str) -> dict[str, Any]:
    """An item as a list shows it: an id, a status, a message's text as parts."""
    shown = {"id": item.get("id") or default_id, "status": item.get("status") or "completed"} \
        | {key: value for key, value in item.items() if key not in ("id", "status")}
    if shown.get("type", "message") == "message":
        kind = "output_text" if shown["role"] == "assistant" else "input_text"
        parts = shown["content"] if isinstance(shown["content"], list) else \
            [{"type": kind, "text": shown["content"]}]
        shown |= {"type": "message", "content": [
            part | {"annotations": part.get("annotations", [])}
            if part["type"] == "output_text" else part for part in parts]}
    return shown


def tokens_before(tokens: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """The tokens of an answer's text before its calls: those whose text, joined (white
    space around it aside), begins `text`; not the calls' after them."""
    joined, kept = "", []
    for token in tokens:
        joined += token["token"]
        if not text.startswith(joined.strip()):
            break
        kept.append(token)
    return kept


def ended(finish_reason: str | None) -> Status:
    """A response cut by its token limit is incomplete, as OpenAI says of it."""
    return "incomplete" if finish_reason == "length" else "completed"


async def events(shape: Shape, chunks: AsyncIterator[dict[str, Any]],
                 keep: Callable[[dict[str, Any]], Awaitable[None]] | None = None
                 ) -> AsyncIterator[str]:
    """The streamed response, as server-sent events (each named, with its type and a
    sequence number), from the chat answer's chunks (`routes.chunk_events`, closed here
    however this ends): the response created and in progress; at the first text the message
    and its text part added, then each piece of text; at the end the text, part and message
    done (a message added there where the answer has neither text nor calls), each call
    the answer made added, its arguments given, and done, and the response done (`keep`
    given it first: it may say it was not kept). A chat error ends it as response.failed,
    not kept."""
    event, where = Events(), shape.where
    yield event("response.created", response=shape.response("in_progress", []))
    yield event("response.in_progress", response=shape.response("in_progress", []))
    pieces: list[str] = []  # the text, as streamed
    held = ""  # white space before any text (an answer of calls alone has no message)
    shown: list[dict[str, Any]] = []  # the tokens' logprobs, each with its text's delta
    waiting: list[dict[str, Any]] = []  # those of tokens whose text has not come yet
    calls: list[dict[str, Any]] = []  # the chat's tool calls (all in its last chunks)
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
                if (piece := choice["delta"].get("content")) and not pieces and \
                        not (held + piece).strip():
                    held += piece
                elif piece:
                    if not pieces:
                        for added in opening(shape, event):
                            yield added
                        piece, held = held + piece, ""
                    pieces.append(piece)
                    yield event("response.output_text.delta", delta=piece, logprobs=waiting,
                                **where)
                    shown, waiting = shown + waiting, []
                calls += choice["delta"].get("tool_calls") or []
                finish = choice["finish_reason"] or finish
            usage = chunk.get("usage") or usage
    if not pieces and not calls:  # an empty answer (or white space) is a message
        for added in opening(shape, event):
            yield added
        if held:
            pieces.append(held)
            yield event("response.output_text.delta", delta=held, logprobs=waiting, **where)
            shown, waiting = shown + waiting, []
    # the end repeats every token's logprobs four times: thousands, each with its top ones,
    # take a fraction of a second that every other stream would wait (routes.shown)
    text = "".join(pieces) if pieces or not calls else None
    heavy = bool(shown or waiting)
    # the tokens of the calls (waiting: they have no text) are no part of the message
    end = (shape, event, text, calls, ended(finish), usage, shown if calls else shown + waiting)
    done, response = await asyncio.to_thread(closing, *end) if heavy else closing(*end)
    for each in done:
        yield each
    if keep is not None:  # before the client reads that it is done (and may go on from it)
        await keep(response)
    name = f"response.{response['status']}"
    yield await asyncio.to_thread(event, name, response=response) if heavy else \
        event(name, response=response)


class Events:
    """Names and numbers a stream's events."""

    def __init__(self) -> None:
        self.numbers = itertools.count()

    def __call__(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": next(self.numbers)} | fields
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"


def opening(shape: Shape, event: Events) -> list[str]:
    """The message and its text part added (the first item of the output)."""
    return [event("response.output_item.added", output_index=0,
                  item=shape.message(None, "in_progress")),
            event("response.content_part.added", part=text_part(""), **shape.where)]


def closing(shape: Shape, event: Events, text: str | None, calls: list[dict[str, Any]],
            status: Status, usage: dict[str, Any] | None, logprobs: list[dict[str, Any]]
            ) -> tuple[list[str], dict[str, Any]]:
    """The events that end a stream whose text and calls are all there (the text, its part
    and the message done, `text` None: no message; each call added, its arguments given
    and done), and the response done."""
    where, output, done = shape.where, [], []
    if text is not None:
        message = shape.message(text, status, logprobs)
        output.append(message)
        done += [event("response.output_text.done", text=text, logprobs=logprobs, **where),
                 event("response.content_part.done", part=text_part(text, logprobs), **where),
                 event("response.output_item.done", output_index=0, item=message)]
    for i, call in enumerate(calls):
        at, item = len(output), shape.call(call, i, status)
        place = {"item_id": item["id"], "output_index": at}
        output.append(item)
        done += [event("response.output_item.added", output_index=at,
                       item=shape.call(call, i, "in_progress")),
                 event("response.function_call_arguments.delta", delta=item["arguments"],
                       **place),
                 event("response.function_call_arguments.done", arguments=item["arguments"],
                       **place),
                 event("response.output_item.done", output_index=at, item=item)]
    return done, shape.response(status, output, usage)
