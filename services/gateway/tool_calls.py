"""Tool calls in a model's answer, in the format its chat template teaches it (pure logic).

A chat template that offers tools tells the model how to call one; this server reads the
format of Hermes, which Qwen 2.5, Qwen 3 and the Hermes models are trained on:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block a call, any text around them the answer's content. A model that ends its turn
inside a block (no closing tag) still made the call if what it wrote parses. A block whose
JSON does not parse, or names no function, is not a call: the whole answer stays text, as the
model wrote it, rather than calls made up from part of it.

Streamed, text goes out as it comes until a block may begin (a tail that could be the start
of `<tool_call>` waits for the next piece); from there the answer is held and read whole at
its end, and its calls go out as one delta each."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


def call_format(template: str | None, decode_keeps_tags: bool = True) -> str | None:
    """The call format a chat template teaches, or None: "hermes" where it shows tools and
    asks for <tool_call> blocks of JSON with the call's "arguments" (not Qwen3-Coder's
    `<function=...>` blocks), and the model's text keeps the tags (a tokenizer that marks
    them special drops them from the text, and the calls with them)."""
    if (template and "tools" in template and OPEN in template and '"arguments"' in template
            and "<function=" not in template and decode_keeps_tags):
        return "hermes"
    return None


def tool_call(name: str, arguments: Any) -> dict[str, Any]:
    """A call as OpenAI's answers carry it: an id of its own, the arguments as a JSON string."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": text}}


@dataclass(frozen=True)
class Answer:
    content: str | None  # the text outside the calls (None: none but white space)
    calls: list[dict[str, Any]] = field(default_factory=list)


def parse(text: str, parallel: bool = True) -> Answer:
    """The calls in a whole answer and the text around them; no calls if any block is not
    one (the answer as written). A call's arguments are its "arguments" (or "parameters",
    as Llama-style calls name them); a block with neither is not a call. `parallel` False:
    the first call only (the client asked for at most one)."""
    if OPEN not in text:
        return Answer(text)
    calls = []
    for block in BLOCK.finditer(text):
        try:
            call = json.loads(block[1])
        except ValueError:
            return Answer(text)
        if not isinstance(call, dict):
            return Answer(text)
        name, arguments = call.get("name"), call.get("arguments", call.get("parameters"))
        if not isinstance(name, str) or not name or not isinstance(arguments, dict | str):
            return Answer(text)
        calls.append(tool_call(name, arguments))
    content = BLOCK.sub("", text).strip()
    return Answer(content or None, calls if parallel else calls[:1])


class Splitter:
    """A streamed answer's text as it may be shown: `feed` gives what can go out now (all of
    it until a call may begin), `end` the held rest read as calls and text."""

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel  # False: the first call only
        self.held = ""  # from where a block may begin
        self.calling = False  # a block began: everything after is held to the end

    def feed(self, text: str) -> str:
        if self.calling:
            self.held += text
            return ""
        text = self.held + text
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
        if not self.calling:
            return Answer(held or None)
        answer = parse(held, self.parallel)
        return answer if answer.calls else Answer(held)
