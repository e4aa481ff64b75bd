"""OpenAI's API shapes, in one place and pure (no I/O): request models with their validation,
the error envelope, ids, response and chunk envelopes, choices, usage, logprobs and SSE."""

from __future__ import annotations

import contextlib
import json
import re
import time
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from shared.engine.request import MAX_TOP_LOGPROBS  # the engine's bound, OpenAI's
from shared.engine.structured import (
    choice_grammar,
    json_grammar,
    regex_grammar,
    text_grammar,
)

MAX_STOPS = 4
MAX_STOP_CHARS = 256  # longer stop strings cannot match a reply in any useful way
MAX_CHOICES = 128  # OpenAI's bound on n
MAX_LOGIT_BIAS = 300  # OpenAI's bound on the tokens a logit_bias names
MAX_TOOLS = 128  # OpenAI's bound on the tools a request offers
TOKEN_ID = re.compile(r"[0-9]{1,9}")  # ASCII digits only ("²".isdigit() is True)


class APIError(Exception):
    """An error the client gets back in OpenAI's shape. `counted`: the request's outcome is
    in `ds_requests` already (it failed on the instances, which the gateway counts as it
    ends), not to be counted again as it is answered."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None, counted: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (status, message, param,
                                                                       code, kind)
        self.headers, self.counted = headers or {}, counted

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.param, self.code)


class ContextExceeded(APIError):
    """A 400: the prompt and the completion do not fit the context of the instances the
    request went to; `room` is how many prompt tokens would."""

    def __init__(self, message: str, param: str, room: int) -> None:
        super().__init__(400, message, param, "context_length_exceeded")
        self.room = room


class ParamError(ValueError):
    """A request-wide validator's refusal that one parameter is to blame for: the error
    names it (`param`), as a field's own validator's does."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def error_body(message: str, kind: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _encodable(text: str) -> str:
    """A lone surrogate ("\\ud800") is valid JSON but not text: refuse it here, before it
    reaches the tokenizer or a NATS message."""
    try:
        text.encode()
    except UnicodeEncodeError as e:
        raise ValueError(f"the text is not valid Unicode ({e.reason} at position "
                         f"{e.start})") from None
    return text


Text = Annotated[str, AfterValidator(_encodable)]

class JSONModel(BaseModel):
    """A part of a request: JSON's types as they are, as OpenAI reads them ("max_tokens":
    "5", true or 5.5 and "stream": "yes" are a 400 naming the parameter, not read as 5, 1, 5
    and true, as pydantic's lax mode would). An int where a float goes is still a number."""

    model_config = ConfigDict(strict=True)


def _whole(value: Any) -> Any:
    """2.0 is the integer 2, as JSON Schema reads it (the OpenAPI schema served says
    "integer", and generated clients may send one so); 2.5 is none."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_whole)]  # an integer of a JSONModel
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]


class StreamOptions(JSONModel):
    include_usage: bool = False


def _takes_null(annotation: Any) -> bool:
    return type(None) in typing.get_args(annotation)


class RequestBody(JSONModel):
    """A request's body: JSON's types as they are, parameters it does not know ignored, an
    explicit null read as the parameter's default."""

    # NaN and infinity (Python's JSON reads them) are no numbers a parameter takes
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """An explicit null is the parameter's default, as OpenAI reads it (the openai client
        sends null for a None, and wrappers pass None for what they leave out); a field
        that takes null keeps it (`max_tokens: null`: as many as fit)."""
        if not isinstance(data, dict):
            return data
        return {key: value for key, value in data.items() if value is not None
                or key not in cls.model_fields or _takes_null(cls.model_fields[key].annotation)}


class JSONSchemaFormat(JSONModel):
    """response_format's json_schema: the schema the answer is held to. `strict`: a keyword
    the decoding cannot hold the answer to is a 400 (not: it is ignored)."""

    name: Text = Field(default="response", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class Format(JSONModel):
    """What an answer is held to: a grammar the instances decode within, token by token
    (shared/engine/structured.py). Built and checked off the event loop (Gateway.grammar):
    a schema's compile can take a while."""

    def build(self) -> str:
        """The grammar ("" for none); ValueError says why the answer cannot be held to it."""
        raise NotImplementedError


class ResponseFormat(Format):
    """OpenAI's: free text, any JSON object, or JSON valid against a schema."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or
                                           self.json_schema.schema_ is None):
            raise ValueError("response_format json_schema needs its json_schema's schema "
                             "({\"name\": ..., \"schema\": {...}})")
        return self

    def build(self) -> str:
        if self.type == "text":
            return ""
        spec = self.json_schema or JSONSchemaFormat()
        return json_grammar(spec.schema_ if self.type == "json_schema" else None,
                            bool(spec.strict))


class StructuredOutputs(Format):
    """vLLM's `structured_outputs` (and its `guided_*` parameters before 0.12): one of JSON
    valid against a schema (`json`: the schema or its text), the whole text matching a
    `regex`, exactly one of the strings in `choice`, a context-free `grammar` (Lark's
    syntax or llama.cpp's GBNF), or any JSON object (`json_object`: true)."""

    json_: dict[str, Any] | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputs:
        given = [value for value in (self.json_, self.regex, self.choice, self.grammar,
                                     self.json_object or None) if value is not None]
        if len(given) != 1:
            raise ValueError("structured_outputs takes one of json, regex, choice, grammar "
                             f"or json_object: true ({len(given)} given)")
        return self

    def build(self) -> str:
        if self.json_ is not None:
            return json_grammar(self.json_)
        if self.regex is not None:
            return regex_grammar(self.regex)
        if self.choice is not None:
            return choice_grammar(self.choice)
        if self.grammar is not None:
            return text_grammar(self.grammar)
        return json_grammar(None)


class _Common(RequestBody):
    model: Text
    max_tokens: Int | None = Field(default=None, ge=1)
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: Int = Field(default=0, ge=-1)  # extension (vLLM's): -1 or 0 = no cut
    seed: Int | None = None
    stop: Text | list[Text] | None = None
    n: Int = Field(default=1, ge=1, le=MAX_CHOICES)  # each choice its own request
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension: generate exactly max_tokens (benchmarks)
    # extension (vLLM's): a prompt is found in the prefix cache only by requests that send
    # the same salt (tenants kept apart; a benchmark's runs apart)
    cache_salt: Text | None = Field(default=None, min_length=1, max_length=256)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    # token id (as a string) -> added to its logit, -100 (never) to 100 (only)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        default=None, max_length=MAX_LOGIT_BIAS)

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # extension (vLLM's)
    # vLLM's before 0.12: read as structured_outputs' json, regex, choice and grammar
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    # a chat's: auto, none, required or one function named (ChatRequest.forced_functions)
    tool_choice: str | dict[str, Any] | None = None

    @model_validator(mode="after")
    def _served(self) -> _Common:
        """Two formats the answer would be held to, or one with ignore_eos."""
        formats = self._formats()
        if len(formats) > 1:
            raise ParamError(formats[1][0], f"{formats[0][0]} and {formats[1][0]} each hold "
                                            "the answer to a format: send one")
        if formats and self.ignore_eos:
            raise ParamError("ignore_eos", f"ignore_eos would run the answer past the end of "
                                           f"its format ({formats[0][0]}): send one of them")
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options goes with stream: true")
        return self

    def _formats(self) -> list[tuple[str, Format]]:
        """The formats asked for, each with the parameter that asks it."""
        formats: list[tuple[str, Format]] = []
        if self.response_format is not None and self.response_format.type != "text":
            formats.append(("response_format", self.response_format))
        if self.structured_outputs is not None:
            formats.append(("structured_outputs", self.structured_outputs))
        for kind in ("json", "regex", "choice", "grammar"):
            if (value := getattr(self, f"guided_{kind}")) is not None:
                formats.append((f"guided_{kind}", StructuredOutputs.model_validate(
                    {kind: value})))
        return formats

    @property
    def format_param(self) -> str | None:
        """The parameter that holds the answer to a format, if one does."""
        formats = self._formats()
        return formats[0][0] if formats else None

    def grammar(self) -> str:
        """The grammar the answer is held to ("" for none); ValueError says why it cannot
        be held to it (built here, not checked: Gateway.grammar)."""
        formats = self._formats()
        return formats[0][1].build() if formats else ""

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if any(TOKEN_ID.fullmatch(key) is None for key in bias or {}):
            raise ValueError("logit_bias maps token ids (integers, as strings) to biases")
        if len({int(key) for key in bias or {}}) != len(bias or {}):
            raise ValueError("logit_bias names a token twice")
        return bias

    @property
    def bias_list(self) -> list[tuple[int, float]]:
        return [(int(token), bias) for token, bias in (self.logit_bias or {}).items()]

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOPS or any(not 0 < len(s) <= MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop takes up to {MAX_STOPS} non-empty strings of at most "
                             f"{MAX_STOP_CHARS} characters")
        return stop

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Common):
    # one prompt (text or token ids) or several, each answered by its own n choices
    prompt: Text | list[Int] | list[Text] | list[list[Int]]
    logprobs: Int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    max_tokens: Int | None = Field(default=16, ge=0)  # 0: the echoed prompt scored only
    best_of: Int | None = Field(default=None, ge=1)  # served only as n (each choice once)
    suffix: Text | None = None  # not served (text after an insertion)

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt: str | list[int] | list[str] | list[list[int]]
                 ) -> str | list[int] | list[str] | list[list[int]]:
        several = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
        prompts: list[Any] = list(prompt) if several else [prompt]
        if not prompts or any(not p for p in prompts):
            raise ValueError("the prompt is empty")
        if len(prompts) > MAX_CHOICES:
            raise ValueError(f"at most {MAX_CHOICES} prompts a request")
        return prompt

    @model_validator(mode="after")
    def _choices(self) -> CompletionRequest:
        if self.tool_choice not in (None, "auto", "none"):
            raise ParamError("tool_choice", "tool_choice goes with tools, which a chat "
                             "offers (/v1/chat/completions)")
        if self.best_of not in (None, 1, self.n):
            raise ParamError("best_of", "best_of is not served: each of the n choices is "
                             "sampled once; leave best_of out (or equal to n)")
        if self.suffix:
            raise ParamError("suffix", "suffix (the text after an insertion) is not served")
        if self.max_tokens == 0 and not self.echo:
            raise ParamError("max_tokens", "max_tokens 0 generates nothing: it goes with "
                             "echo (the prompt and, with logprobs, its scores)")
        if len(self.prompts) * self.n > MAX_CHOICES:
            raise ParamError("n", f"{len(self.prompts)} prompts x n={self.n} choices: at "
                             f"most {MAX_CHOICES} choices a request")
        return self

    @property
    def token_limit(self) -> int | None:
        """What the instances generate: one token where max_tokens is 0 (the prompt is
        scored in its prefill, which samples a token the answer leaves out)."""
        return None if self.max_tokens is None else max(1, self.max_tokens)

    @property
    def generates(self) -> bool:
        return self.max_tokens != 0

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    @property
    def top_count(self) -> int:
        return self.logprobs or 0

    @property
    def scores_prompt(self) -> bool:
        """The prompt's tokens scored too (echo with logprobs: what evaluation harnesses
        read a text's likelihood from)."""
        return self.echo and self.logprobs is not None

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt, as text or token ids."""
        if isinstance(self.prompt, list) and not isinstance(self.prompt[0], int):
            return list(self.prompt)
        return [self.prompt]


def text_only(content: Any, kinds: set[str]) -> Any:
    """`content`, where its parts are all of the text `kinds`: parts of another type (an
    image, audio, a file) get a 400 that names them, not a validation error about strings."""
    for part in content if isinstance(content, list) else []:
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind not in kinds:
            raise ValueError(f"this model reads text only: a content part of type "
                             f"'{kind[:64]}' cannot be served")
    return content


class TextPart(JSONModel):
    type: Literal["text"]
    text: Text


class FunctionCall(JSONModel):
    model_config = ConfigDict(extra="allow")

    name: Text
    arguments: Text = "{}"  # JSON, as the model wrote it


class ToolCall(JSONModel):
    """A call the assistant made earlier in the conversation, passed to the chat template
    as it came (templates that know tools render it)."""

    model_config = ConfigDict(extra="allow")

    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict[str, Any]:
        call = self.model_dump(exclude_none=True)
        with contextlib.suppress(ValueError):
            if isinstance(arguments := json.loads(self.function.arguments), dict):
                call["function"]["arguments"] = arguments
        return call


class _Message(JSONModel):
    role: str
    content: Text | list[TextPart] | None = None
    name: Text | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        return text_only(content, {"text"})

    @property
    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: content as one string, the other fields
        only where given."""
        message: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.name is not None:
            message["name"] = self.name
        return message


class _SaidMessage(_Message):
    role: Literal["system", "user", "developer", "tool"]
    content: Text | list[TextPart]
    tool_call_id: Text | None = None  # a tool's answer: the call it answers

    def for_template(self) -> dict[str, Any]:
        message = super().for_template()
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class _AssistantMessage(_Message):
    """An assistant turn of the history: its text, or the tool calls it made (an agent's
    turn has no content), or both."""

    role: Literal["assistant"]
    tool_calls: list[ToolCall] | None = None

    def for_template(self) -> dict[str, Any]:
        """(A call's JSON arguments as the object they spell, which templates such as
        Llama 3.1's read.)"""
        message = super().for_template()
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        return message


# One message of the conversation; an agent's history is accepted as the OpenAI client sends
# it: an assistant turn with tool calls and no content, the tools' answers.
ChatMessage = Annotated[_SaidMessage | _AssistantMessage, Field(discriminator="role")]


class FunctionSpec(JSONModel):
    model_config = ConfigDict(extra="allow")

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema, shown to the model


class Tool(JSONModel):
    """A function the model may call, as the chat template shows it to the model."""

    type: Literal["function"]
    function: FunctionSpec


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    # OpenAI's deprecated form of tools: not served (refused where given)
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True  # several calls in one answer (as the model makes them)
    # what the answer is made of: text only is served (audio output is refused, not ignored)
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None  # the voice and format of audio output: refused

    @property
    def offered_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template reads them, where the model may call them (not
        with tool_choice "none": then they are not shown to it at all)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    @property
    def forced_functions(self) -> list[dict[str, Any]] | None:
        """The functions the answer must call one of (tool_choice "required": any tool's;
        {"type": "function", "function": {"name": ...}}: that one's), or None where the
        model chooses (auto) or calls none. The answer is held to the call format then
        (tool_calls.forced_grammar). ParamError for a choice no tool offered fits."""
        choice = self.tool_choice
        if choice in (None, "auto", "none"):
            return None
        named = choice.get("function") if isinstance(choice, dict) and \
            choice.get("type") == "function" else None
        name = named.get("name") if isinstance(named, dict) else None
        if choice != "required" and not isinstance(name, str):
            raise ParamError("tool_choice", 'tool_choice takes "auto", "none", "required" or '
                             '{"type": "function", "function": {"name": ...}}')
        functions = [tool.function.model_dump(exclude_none=True) for tool in self.tools or []
                     if name is None or tool.function.name == name]
        if not functions:
            raise ParamError("tool_choice", f"tool_choice names {name!r}, which is not among "
                             "the tools offered" if name is not None else
                             "tool_choice required needs tools to call")
        return functions

    @model_validator(mode="after")
    def _top_with_logprobs(self) -> ChatRequest:
        if self.forced_functions and self.ignore_eos:
            raise ParamError("ignore_eos", "ignore_eos would run the answer past the call "
                             "tool_choice requires: send one of them")
        if self.top_logprobs and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs needs logprobs: true")
        if self.functions or self.function_call not in (None, "none"):
            raise ParamError("functions" if self.functions else "function_call",
                             "functions and function_call (deprecated by OpenAI) are not "
                             "served: send tools and tool_choice")
        if self.offered_tools and self.format_param is not None:
            raise ParamError(self.format_param, f"tools and {self.format_param} at once are not "
                             "served: an answer held to a format cannot call a tool (send "
                             "tool_choice: none to leave the tools out)")
        if self.audio is not None or set(self.modalities or ()) - {"text"}:
            raise ParamError("audio" if self.audio is not None else "modalities",
                             "audio output is not served: answers are text (modalities: "
                             "[\"text\"])")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs

    @property
    def top_count(self) -> int:
        return self.top_logprobs or 0

    @property
    def scores_prompt(self) -> bool:
        return False  # a chat has no echo

    @property
    def generates(self) -> bool:
        return True


# -- responses ---------------------------------------------------------------------------

def response_id(request_id: str, chat: bool) -> str:
    """The OpenAI id of a request: its internal id (the one in its traces) with OpenAI's
    prefix, so a client's id finds the request's trace."""
    return ("chatcmpl-" if chat else "cmpl-") + request_id


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    """OpenAI's usage block; `cached`: the prompt tokens found in the KV pool (prefix
    caching), not computed."""
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


@dataclass(frozen=True)
class TokenLogprob:
    """A token as the logprobs blocks show it: its text (`bytes:\\xe2\\x80` where its bytes
    are part of a character), its own bytes, its logprob."""

    text: str
    piece: bytes
    logprob: float | None  # None: an echoed prompt's first token (nothing precedes it)


def completion_logprobs(tokens: list[TokenLogprob],
                        tops: list[list[TokenLogprob] | None] | None, offsets: list[int]
                        ) -> dict[str, Any]:
    """The legacy block: each position's top tokens as {text: logprob}, the chosen one
    among them where it is not one of the likeliest (as OpenAI shows it: k + 1 entries),
    where asked for (None at an echoed prompt's first token), and where each token starts
    in the text."""
    def top_of(token: TokenLogprob, top: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if top is None:
            return None
        return {c.text: c.logprob for c in top} | {token.text: token.logprob}

    return {"tokens": [t.text for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [top_of(t, top) for t, top in zip(tokens, tops, strict=True)]
            if tops is not None else None,
            "text_offset": offsets}


def chat_logprobs(tokens: list[TokenLogprob], tops: list[list[TokenLogprob]] | None
                  ) -> dict[str, Any]:
    def entry(t: TokenLogprob) -> dict[str, Any]:
        return {"token": t.text, "logprob": t.logprob, "bytes": list(t.piece)}

    return {"content": [entry(t) | {"top_logprobs": [entry(c) for c in top]}
                        for t, top in zip(tokens, tops or [[] for _ in tokens], strict=True)]}


def envelope(response_id: str, model: str, chat: bool, stream: bool) -> dict[str, Any]:
    kind = ("chat.completion.chunk" if stream else "chat.completion") if chat \
        else "text_completion"
    return {"id": response_id, "object": kind, "created": int(time.time()), "model": model,
            "system_fingerprint": None}


def choice(chat: bool, text: str | None, finish: str | None, logprobs: dict[str, Any] | None,
           stream: bool, index: int = 0, tool_calls: list[dict[str, Any]] | None = None
           ) -> dict[str, Any]:
    """A choice of an answer or a chunk; `tool_calls` (chat): the calls the model made, as
    OpenAI's message carries them (a chunk's delta: each with its index among them)."""
    if not chat:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    if stream:
        delta: dict[str, Any] = {"content": text} if text else {}
        if tool_calls:
            delta["tool_calls"] = [{"index": i} | call for i, call in enumerate(tool_calls)]
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}


def first_chat_chunk(index: int = 0) -> dict[str, Any]:
    """The role announcement that opens a streamed chat answer's choice."""
    return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
            "finish_reason": None}
