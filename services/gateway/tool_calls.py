"""Tool calls in a model's answer, in the format its chat template teaches it (pure logic).

A chat template that offers tools tells the model how to call one. This server reads two
formats. Hermes' (`hermes`), which Qwen 2.5's and Qwen 3's templates teach:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block a call, any text around them the answer's content; a model that ends its turn
inside a block (no closing tag) still made the call if what it wrote parses. And Llama 3.1's
and 3.2's (`llama3_json`): an answer that is nothing but a call's JSON,

    {"name": "get_weather", "parameters": {"city": "Paris"}}

(several separated by ";"). An answer whose would-be call does not parse, or names no
function or no arguments, is not a call: it stays text, as the model wrote it, rather than
calls made up from part of it.

Streamed, text goes out as it comes until a call may begin (Hermes: a tail that could be the
start of `<tool_call>` waits for the next piece; Llama: an answer whose first character is
`{`); from there the answer is held and read whole at its end, and its calls go out as one
delta each."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from shared.engine.structured import json_items_grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# what Llama 3.1's and 3.2's templates ask of a model given tools
LLAMA3_ASKS = '{"name": function name, "parameters": dictionary of argument name'
PYTHON_TAG = "<|python_tag|>"  # Llama 3's call marker (a special token: rarely in the text)


def call_format(template: str | None, decode_keeps_tags: bool = True) -> str | None:
    """The call format a chat template teaches, or None: "hermes" where it shows tools and
    asks for <tool_call> blocks of a call's JSON (its "arguments", or Llama's "parameters":
    not Qwen3-Coder's `<function=...>` blocks or GLM's `<arg_key>` ones) and the model's text
    keeps the tags (a tokenizer that marks them special drops them from the text, and the
    calls with them); else "llama3_json" where it asks for a call's JSON with its
    "parameters", as Llama 3.1's and 3.2's do."""
    if not template or "tools" not in template:
        return None
    if (OPEN in template and ('"arguments"' in template or LLAMA3_ASKS in template)
            and "<function=" not in template and decode_keeps_tags):
        return "hermes"
    if LLAMA3_ASKS in template:
        return "llama3_json"
    return None


MOST_CALLS = 8  # in an answer held to calls where several may be made
# what a schema says to a reader, not to the decoding: left out of a call's grammar, which a
# client's many described tools would otherwise swell past its bound
ANNOTATIONS = {"description", "title", "examples", "$comment"}
NAMED = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
VALUES = {"enum", "const", "default", "examples"}


def bare(schema: Any) -> Any:
    """A JSON schema without its annotations (a property named "title" stays one)."""
    if isinstance(schema, list):
        return [bare(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    return {key: value if key in VALUES else
            {name: bare(s) for name, s in value.items()} if key in NAMED and
            isinstance(value, dict) else bare(value)
            for key, value in schema.items() if key not in ANNOTATIONS}


def arguments_schema(function: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters as its call's arguments must match them: an object (OpenAI's
    parameters are one); ValueError for a schema of something else."""
    parameters: dict[str, Any] = bare(function.get("parameters") or {})
    if parameters.get("type", "object") != "object":
        raise ValueError(f"the parameters of {function['name']!r} are no object schema "
                         f"(type {parameters['type']!r})")
    return {"type": "object"} | parameters


def forced_grammar(functions: list[dict[str, Any]], form: str, most: int = 1) -> str:
    """The grammar of an answer that is nothing but a call, in `form`, of one of `functions`
    (OpenAI's function specs: name, parameters), its arguments valid against its parameters
    (up to `most` calls). ValueError if no answer can be."""
    key = "arguments" if form == "hermes" else "parameters"
    calls = [(f'{{"name": {json.dumps(f["name"])}, "{key}": ', arguments_schema(f), "}")
             for f in functions]
    strict = all(f.get("strict") is True for f in functions)
    if form == "hermes":
        return json_items_grammar(calls, OPEN + "\n", "\n" + CLOSE, "\n", most, strict)
    return json_items_grammar(calls, "", "", "; ", most, strict)


def tool_call(name: str, arguments: Any) -> dict[str, Any]:
    """A call as OpenAI's answers carry it: an id of its own, the arguments as a JSON string
    (strict JSON: a NaN the model wrote raises ValueError, no call)."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, allow_nan=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": text}}


def finish_reason(reason: str | None, calls: list[dict[str, Any]]) -> str | None:
    """An answer's finish as OpenAI gives it: "tool_calls" where the model ended its turn
    with calls."""
    return "tool_calls" if calls and reason == "stop" else reason


@dataclass(frozen=True)
class Answer:
    content: str | None  # the text outside the calls (None: none but white space)
    calls: list[dict[str, Any]] = field(default_factory=list)


def _call(value: Any) -> dict[str, Any] | None:
    """A parsed object as a call, if it is one: a name and its arguments ("arguments", or
    "parameters" as Llama's calls name them), an object or a string of one's JSON (a
    client reads them as one: `"arguments": "Paris"` is no call)."""
    if not isinstance(value, dict):
        return None
    name, arguments = value.get("name"), value.get("arguments", value.get("parameters"))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return tool_call(name, arguments)


def parse(text: str, parallel: bool = True, form: str = "hermes") -> Answer:
    """The calls in a whole answer and the text around them; no calls if any would-be call
    is not one (the answer as written). `parallel` False: the first call only (the client
    asked for at most one)."""
    found = _hermes(text) if form == "hermes" else _llama3(text)
    if found is None:
        return Answer(text)
    calls, content = found
    return Answer(content.strip() or None, calls if parallel else calls[:1])


def _hermes(text: str) -> tuple[list[dict[str, Any]], str] | None:
    """The calls of the answer's blocks, each its call's JSON between <tool_call> and
    </tool_call> (or the end: a model that ends its turn inside a block), read as JSON, so a
    closing tag inside one of its strings (code a call writes) does not end it; and the
    text around them."""
    if OPEN not in text:
        return None
    decoder, calls, kept, at = json.JSONDecoder(), [], [], 0
    while (start := text.find(OPEN, at)) >= 0:
        kept.append(text[at:start])
        body = start + len(OPEN)
        body += len(text[body:]) - len(text[body:].lstrip())
        try:
            value, end = decoder.raw_decode(text, body)
            call = _call(value)
        except (ValueError, RecursionError):  # not JSON; nested past what Python parses
            return None
        if call is None:
            return None
        calls.append(call)
        after = text[end:].lstrip()
        if after.startswith(CLOSE):
            at = len(text) - len(after) + len(CLOSE)
        elif not after:
            at = len(text)
        else:  # more than the call's JSON in its block
            return None
    kept.append(text[at:])
    return calls, "".join(kept)


def _llama3(text: str) -> tuple[list[dict[str, Any]], str] | None:
    """The answer as one call's JSON or several separated by ";", nothing else."""
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return None
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            value, at = decoder.raw_decode(body, at)
            call = _call(value)
        except (ValueError, RecursionError):  # not JSON; nested past what Python parses
            return None
        if call is None:
            return None
        calls.append(call)
        rest = body[at:].lstrip()
        if rest and not rest.startswith(";"):
            return None
        at = len(body) - len(rest.removeprefix(";").lstrip())
    return calls, ""


class Splitter:
    """A streamed answer's text as it may be shown: `feed` gives what can go out now (all of
    it until a call may begin), `end` the held rest read as calls and text."""

    def __init__(self, parallel: bool = True, form: str = "hermes") -> None:
        self.parallel, self.form = parallel, form  # parallel False: the first call only
        self.held = ""  # from where a call may begin
        self.calling = False  # a call began: everything after is held to the end
        self.texting = False  # (Llama) the answer began as text: it is text to its end

    def feed(self, text: str) -> str:
        if self.calling:
            self.held += text
            return ""
        if self.texting:
            return text
        text = self.held + text
        if self.form == "llama3_json":  # a call is the whole answer: its first character
            start = text.lstrip().removeprefix(PYTHON_TAG).lstrip()
            if PYTHON_TAG.startswith(start):  # nothing yet, or the marker's start
                self.held = text
                return ""
            self.calling, self.texting = start.startswith("{"), not start.startswith("{")
            self.held = text if self.calling else ""
            return "" if self.calling else text
        if (at := text.find(OPEN)) >= 0:
            self.calling, self.held = True, text[at:]
            return text[:at]
        # a tail that is the start of OPEN waits for the next piece
        keep = next((k for k in range(min(len(OPEN) - 1, len(text)), 0, -1)
                     if OPEN.startswith(text[-k:])), 0)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep]

    def end(self) -> Answer:
        """The held text at the answer's end: its calls and the text around them (all text
        when it holds none)."""
        held, self.held = self.held, ""
        return self.whole(held) if self.calling else Answer(held or None)

    def whole(self, text: str) -> Answer:
        """A whole answer read at once (not streamed), as this stream would read it."""
        return parse(text, self.parallel, self.form)
