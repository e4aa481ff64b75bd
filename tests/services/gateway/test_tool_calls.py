"""Tool calls read from a model's answer (Hermes' <tool_call> blocks, Llama 3's JSON): whole,
and streamed in pieces cut anywhere; the answer as OpenAI's client reads it, whole and
streamed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from services.gateway.openai_api import ChatRequest
from services.gateway.routes import Call, Reply, collect, stream_events
from services.gateway.tool_calls import (
    MOST_CALLS,
    Splitter,
    arguments_schema,
    bare,
    call_format,
    forced_grammar,
    parse,
)
from shared.messages import Sampling, TokenChunk

WEATHER = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "time", "arguments": "{\\"tz\\": \\"CET\\"}"}\n</tool_call>'
HERMES_TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
                   "</tools> Call one as <tool_call>{\"name\": ..., \"arguments\": ...}"
                   "</tool_call>{% endif %}"
                   "{% for m in messages %}{{ m.content }}{% endfor %}")


def names_and_arguments(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_calls_and_the_text_around_them() -> None:
    answer = parse(f"Let me look.\n{WEATHER}\n{TIME}")
    assert answer.content == "Let me look."
    assert names_and_arguments(answer.calls) == [("weather", {"city": "Paris"}),
                                                 ("time", {"tz": "CET"})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in answer.calls)
    assert len({c["id"] for c in answer.calls}) == 2
    assert parse(WEATHER).content is None  # nothing but the call
    assert parse("no call here").calls == []
    # a turn ended inside its block (no closing tag) still made the call it wrote whole
    assert names_and_arguments(parse('<tool_call>{"name": "f", "arguments": {}}').calls) == [
        ("f", {})]
    # Llama-style "parameters" are the arguments; asked for one call, the first only
    assert names_and_arguments(parse('<tool_call>{"name": "f", "parameters": {"a": 1}}').calls
                               ) == [("f", {"a": 1})]
    assert names_and_arguments(parse(f"{WEATHER}{TIME}", parallel=False).calls) == [
        ("weather", {"city": "Paris"})]


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>',  # cut short
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "f"}</tool_call>',  # no arguments: not a call to run
    '<tool_call>["f"]</tool_call>',
    f'{WEATHER}<tool_call>not json</tool_call>',  # one bad block: no calls made up
    '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',  # not strict JSON
    # arguments as a string must spell an object's JSON, as a client reads them
    '<tool_call>{"name": "f", "arguments": "Paris"}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "[1]"}</tool_call>',
    '<tool_call>{"name": "f", "arguments": ' + "[" * 1200 + "</tool_call>",  # too deep
])
def test_a_block_that_is_not_a_call_leaves_the_answer_as_written(text: str) -> None:
    answer = parse(text)
    assert answer.calls == [] and answer.content == text


def test_a_template_teaches_the_hermes_format_or_none() -> None:
    assert call_format(HERMES_TEMPLATE) == "hermes"
    # a tokenizer that drops the tags from the text (special tokens) loses the calls
    assert call_format(HERMES_TEMPLATE, decode_keeps_tags=False) is None
    # Qwen3-Coder's XML calls: <tool_call><function=name><parameter=...>, no JSON
    assert call_format(HERMES_TEMPLATE + "<function=example>") is None
    assert call_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert call_format(None) is None
    llama = ("{% if tools %}Respond in the format {\"name\": function name, \"parameters\": "
             "dictionary of argument name and its value}.{% endif %}")
    assert call_format(llama) == "llama3_json"
    # Llama's JSON asked for inside <tool_call> blocks: Hermes' blocks ("parameters" read)
    assert call_format(llama + "<tool_call></tool_call>") == "hermes"
    # GLM's <tool_call>name<arg_key>...: the tag, but no JSON asked for
    assert call_format("{% if tools %}<tool_call>{name}<arg_key>k</arg_key></tool_call>"
                       "{% endif %}") is None


@pytest.mark.parametrize("answer", [f"Sure. {WEATHER}", "<tool and more", "a < b", "plain",
                                    f"{WEATHER}{TIME} done", "ends with <tool_"])
def test_a_streamed_answer_cut_anywhere_shows_what_the_whole_one_does(answer: str) -> None:
    whole = parse(answer)
    for cut in range(len(answer) + 1):
        for second in (cut, min(len(answer), cut + 7)):
            splitter = Splitter()
            shown = "".join(splitter.feed(piece) for piece in
                            (answer[:cut], answer[cut:second], answer[second:]))
            end = splitter.end()
            if whole.calls:  # the text before the first call as it came, the rest parsed
                before = answer[:answer.find("<tool_call>")]
                rest = parse(answer[len(before):])
                assert shown + (end.content or "") == before + (rest.content or "")
                assert names_and_arguments(end.calls) == names_and_arguments(whole.calls)
            else:
                assert shown + (end.content or "") == answer and end.calls == []


def test_text_before_a_call_goes_out_before_the_answer_ends() -> None:
    splitter = Splitter()
    assert splitter.feed("It is ") == "It is "
    assert splitter.feed("sunny <tool") == "sunny "  # the tail may begin a call: it waits
    assert splitter.feed("s>, I think") == "<tools>, I think"  # it did not
    assert splitter.feed(" <tool_call>{") == " "
    assert splitter.feed('"name": "f", "arguments": {}}') == ""
    end = splitter.end()
    assert end.content is None and names_and_arguments(end.calls) == [("f", {})]


def test_tools_are_offered_unless_the_choice_is_none() -> None:
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    offered = ChatRequest.model_validate(body).offered_tools
    assert offered == tools
    assert ChatRequest.model_validate(body | {"tool_choice": "none"}).offered_tools is None
    for bad in ([{"type": "function"}], [{"type": "function", "function": {"name": "a b"}}],
                [{"type": "code_interpreter"}]):
        with pytest.raises(ValidationError):
            ChatRequest.model_validate(body | {"tools": bad})


class ScriptedCall(Call):
    """A chat choice whose model wrote `pieces` and stopped."""

    def __init__(self, pieces: list[str], calls: str | None = "hermes") -> None:
        gateway = SimpleNamespace(tokenizer=SimpleNamespace(eos_ids=frozenset({10**6})))
        super().__init__(gateway, True, None, None, [1], Sampling(max_tokens=64),  # type: ignore[arg-type]
                         "r1", calls=calls)
        self.pieces = pieces

    async def chunks(self) -> AsyncIterator[TokenChunk]:  # type: ignore[override]
        for i, piece in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            yield TokenChunk(request_id="r1", token_ids=[i], text=piece,
                             finish_reason="stop" if last else None)


def test_a_whole_answer_carries_its_calls() -> None:
    choice = asyncio.run(collect(ScriptedCall(["Checking. ", WEATHER])))
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking."
    assert names_and_arguments(choice["message"]["tool_calls"]) == [("weather", {"city": "Paris"})]
    plain = asyncio.run(collect(ScriptedCall(["Checking. ", WEATHER], calls=None)))
    assert plain["finish_reason"] == "stop" and "tool_calls" not in plain["message"]


def test_a_streamed_answer_carries_its_calls_in_deltas() -> None:
    async def events() -> list[dict[str, Any]]:
        call = ScriptedCall(["Checking", ". <tool_", WEATHER[6:30], WEATHER[30:], TIME])
        return [json.loads(e.removeprefix("data: ")) async for e in
                stream_events(Reply([call], "m", include_usage=False))
                if e.strip() != "data: [DONE]"]

    chunks = [c["choices"][0] for c in asyncio.run(events())]
    text = "".join(c["delta"].get("content") or "" for c in chunks)
    deltas = [d for c in chunks for d in c["delta"].get("tool_calls", [])]
    assert text == "Checking. "
    assert [d["index"] for d in deltas] == [0, 1]
    assert names_and_arguments(deltas) == [("weather", {"city": "Paris"}), ("time", {"tz": "CET"})]
    # the finish in a chunk of its own after the calls, as OpenAI streams them
    assert chunks[-1]["finish_reason"] == "tool_calls" and chunks[-1]["delta"] == {}
    assert all(c["finish_reason"] is None for c in chunks[:-1])


def test_the_openai_clients_stream_helper_reads_every_call_through() -> None:
    """The client's stream state (`client.chat.completions.stream`) reads a chunk's finish
    before its calls: each call gets its `done` event only if the finish comes apart."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    async def chunks() -> list[str]:
        call = ScriptedCall(["Checking. ", WEATHER, TIME])
        return [e.removeprefix("data: ") async for e in
                stream_events(Reply([call], "m", include_usage=False))
                if e.strip() != "data: [DONE]"]

    state = ChatCompletionStreamState()
    kinds = [event.type for chunk in asyncio.run(chunks())
             for event in state.handle_chunk(ChatCompletionChunk.model_validate_json(chunk))]
    assert kinds.count("tool_calls.function.arguments.done") == 2
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert [c.function.name for c in final.message.tool_calls or []] == ["weather", "time"]


LLAMA_CALL = '{"name": "weather", "parameters": {"city": "Paris"}}'


@pytest.mark.parametrize(("answer", "calls"), [
    (LLAMA_CALL, [("weather", {"city": "Paris"})]),
    (f" <|python_tag|>{LLAMA_CALL}; {LLAMA_CALL.replace('Paris', 'Rome; Italy')}\n",
     [("weather", {"city": "Paris"}), ("weather", {"city": "Rome; Italy"})]),
    ("It is sunny in Paris.", []),
    ('{"name": "weather"}', []),  # no arguments
    (f"{LLAMA_CALL} and then some", []),  # not the whole answer
    ('{"city": "Paris"', []),
    ('{"name": "w", "parameters": ' + "[" * 1200, []),  # nested past what Python parses
])
def test_llama_calls_are_the_whole_answer(answer: str, calls: list[tuple[str, Any]]) -> None:
    whole = parse(answer, form="llama3_json")
    assert names_and_arguments(whole.calls) == calls
    assert whole.content == (None if calls else answer)
    for cut in range(len(answer) + 1):  # streamed in two pieces, cut anywhere
        splitter = Splitter(form="llama3_json")
        shown = splitter.feed(answer[:cut]) + splitter.feed(answer[cut:])
        end = splitter.end()
        assert names_and_arguments(end.calls) == calls
        assert shown + (end.content or "") == ("" if calls else answer)
        if not calls and not answer.lstrip().startswith("{"):
            assert shown == answer[:cut] + answer[cut:]  # text goes out as it comes


def test_a_streamed_llama_answer_goes_out_as_text_or_as_calls() -> None:
    async def events(pieces: list[str]) -> list[dict[str, Any]]:
        call = ScriptedCall(pieces, calls="llama3_json")
        return [json.loads(e.removeprefix("data: "))["choices"][0] async for e in
                stream_events(Reply([call], "m", include_usage=False))
                if e.strip() != "data: [DONE]"]

    text = asyncio.run(events(["It is", " sunny."]))
    assert "".join(c["delta"].get("content") or "" for c in text) == "It is sunny."
    assert text[-1]["finish_reason"] == "stop"
    called = asyncio.run(events([LLAMA_CALL[:9], LLAMA_CALL[9:]]))
    deltas = [d for c in called for d in c["delta"].get("tool_calls", [])]
    assert names_and_arguments(deltas) == [("weather", {"city": "Paris"})]
    assert not any(c["delta"].get("content") for c in called)
    assert called[-1]["finish_reason"] == "tool_calls"


def test_a_closing_tag_inside_a_calls_string_does_not_end_it() -> None:
    code = '<tool_call>\n{"name": "run", "arguments": {"code": "print(\'</tool_call>\')"}}' \
           '\n</tool_call>'
    answer = parse(f"Running it.\n{code}")
    assert answer.content == "Running it."
    assert names_and_arguments(answer.calls) == [("run", {"code": "print('</tool_call>')"})]
    assert parse('<tool_call>\n{"name": "run", "arguments": {}} and more\n</tool_call>').calls \
        == []  # more than the call's JSON in its block: text, as written


def test_a_forced_calls_grammar_reads_the_functions_as_the_decoding_needs_them() -> None:
    """Annotations left out (a property named "title" kept), an object where the parameters
    say no type, refused where they are no object; one call named, up to MOST_CALLS."""
    described = {"type": "object", "description": "x", "title": "T", "$defs": {
        "D": {"type": "integer", "description": "y"}}, "properties": {
            "title": {"type": "string", "title": "t", "enum": [{"description": "kept"}]},
            "d": {"$ref": "#/$defs/D"}}}
    assert bare(described) == {"type": "object", "$defs": {"D": {"type": "integer"}},
                               "properties": {"title": {"type": "string", "enum": [
                                   {"description": "kept"}]}, "d": {"$ref": "#/$defs/D"}}}
    assert arguments_schema({"name": "f", "parameters": {"properties": {}}})["type"] == "object"
    with pytest.raises(ValueError, match="no object schema"):
        arguments_schema({"name": "f", "parameters": {"type": "array"}})
    one = forced_grammar([{"name": "f"}], "hermes")
    several = forced_grammar([{"name": "f"}, {"name": "g"}], "llama3_json", MOST_CALLS)
    assert "{0," not in one and f"{{0,{MOST_CALLS - 1}}}" in several
