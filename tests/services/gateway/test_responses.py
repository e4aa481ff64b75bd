"""The Responses API's pure parts (services/gateway/responses.py): the request read and the
chat request it becomes, what is refused and why, the answer and the stream of events shaped
from a chat answer's. (The route through a real stack: test_gateway.py.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic import ValidationError

from services.gateway.openai_api import ChatRequest, ParamError
from services.gateway.responses import (
    ResponsesRequest,
    Shape,
    events,
    item_list,
    latest_turns,
    turn_starts,
)


def request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi"} | fields)


def test_the_input_becomes_a_chat_after_the_instructions() -> None:
    asked = request(instructions="Be brief.", max_output_tokens=9, temperature=0, stream=True,
                    input=[{"role": "user", "content": [
                               {"type": "input_text", "text": "a"},
                               {"type": "input_text", "text": "b"}]},
                           {"type": "message", "role": "assistant", "content": "ok"},
                           {"role": "developer", "content": "more"}])
    assert asked.chat() == {
        "model": "m", "temperature": 0.0, "top_p": 1.0, "stream": True,
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "ab"},
                     {"role": "assistant", "content": "ok"},
                     {"role": "developer", "content": "more"}],
        "max_completion_tokens": 9, "stream_options": {"include_usage": True}}
    # text alone is a user's message; unlimited, unstreamed
    assert request(instructions=None, max_output_tokens=None).chat() == {
        "model": "m", "temperature": 1.0, "top_p": 1.0, "stream": False,
        "messages": [{"role": "user", "content": "hi"}]}
    # logprobs, asked by include (as OpenAI reads it), with top_logprobs of the likeliest
    logprobs = request(include=["message.output_text.logprobs"]).chat()
    assert (logprobs["logprobs"], logprobs["top_logprobs"]) == (True, 0)
    logprobs = request(include=["message.output_text.logprobs"], top_logprobs=3).chat()
    assert (logprobs["logprobs"], logprobs["top_logprobs"]) == (True, 3)
    assert "logprobs" not in request(include=["reasoning.encrypted_content"],
                                     top_logprobs=3).chat()


def test_a_text_format_is_the_chats_response_format_and_shown_back() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    asked = request(text={"format": {"type": "json_schema", "name": "thing", "schema": schema,
                                     "strict": True}})
    assert asked.chat()["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "thing", "schema": schema, "strict": True}}
    shown = Shape(asked, "abc", created_at=5).answer(chat_answer('{"a": 1}', "stop"))
    assert shown["text"] == {"format": {"type": "json_schema", "name": "thing",
                                        "schema": schema, "strict": True}}
    anything = request(text={"format": {"type": "json_object"}})
    assert anything.chat()["response_format"] == {"type": "json_object"}
    assert "response_format" not in request(text={"format": {"type": "text"}}).chat()


@pytest.mark.parametrize(("fields", "says"), [
    ({"input": ""}, "the input is empty"),
    ({"input": []}, "the input is empty"),
    ({"input": [{"type": "reasoning", "summary": []}]},
     "input items of type 'reasoning' are not served"),
    ({"input": [{"type": ["x"], "role": "user", "content": "hi"}]},
     "are not served: send messages"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [
        {"type": "input_image", "image_url": "x"}]}]},
     "a content part of type 'input_image' cannot be served"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "Field required"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "a content part of type 'input_image' cannot be served"),
    ({"input": [{"role": "user"}]}, "Field required"),  # not "should be a valid string"
    ({"input": [{"role": "user", "content": None}]}, "valid string"),
    ({"input": {"role": "user", "content": "hi"}}, "valid list"),
    ({"conversation": "conv_1"}, "conversation objects are not kept"),
    ({"prompt": {"id": "pmpt_1"}}, "stored prompts are not served"),
    ({"text": {"format": "text"}}, "valid dictionary"),  # a 400, not a 500
    ({"background": True}, "background responses are not served"),
    ({"tools": [{"type": "web_search"}]}, "tools of type 'web_search' are not served"),
    ({"tools": [{"type": "function", "name": "a b"}]}, "should match pattern"),
    ({"tool_choice": {"type": "file_search"}}, 'tool_choice takes "auto", "none"'),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice takes"),
    # what the chat it amounts to refuses, in the Responses API's words
    ({"tool_choice": "required"}, "tool_choice required needs tools to call"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {
        "type": "function", "name": "g"}}, "names 'g', which is not among the tools"),
    ({"tools": [{"type": "function", "name": "f"}], "text": {"format": {
        "type": "json_object"}}}, "tools and text.format at once are not served"),
    ({"text": {"format": {"type": "xml"}}}, "'text', 'json_object' or 'json_schema'"),
    ({"max_output_tokens": "5"}, "valid integer"),
    ({"top_logprobs": 21}, "less than or equal to 20"),
])
def test_what_is_not_served_is_refused_saying_why(fields: dict[str, Any], says: str) -> None:
    with pytest.raises(ValidationError, match=says) as refused:
        request(**fields)
    assert says in refused.value.errors()[0]["msg"]  # what the client is told: the first


def test_what_asks_for_nothing_unserved_is_accepted() -> None:
    """What the openai client sends as None is the default; the text format, tool choice and
    store as they are by default."""
    asked = request(instructions=None, tools=[], tool_choice="auto", store=True,
                    text={"format": {"type": "text"}, "verbosity": "low"}, metadata={"k": "v"},
                    temperature=None, include=["reasoning.encrypted_content"], top_logprobs=0)
    assert asked.temperature == 1.0 and asked.metadata == {"k": "v"}


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather now.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
           "strict": True}
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
        "arguments": '{"city": "Paris"}'}


def test_an_agents_turns_become_the_chats_messages_and_its_tools_the_chats() -> None:
    """Calls sent back join their turn's text (the output items of one answer), or make an
    assistant turn of their own; each output is a tool message answering its call. The
    chat request it becomes is one the chat route takes."""
    said = {"type": "message", "role": "assistant", "status": "completed",
            "id": "msg_1", "content": [{"type": "output_text", "text": "Let me look.",
                                        "annotations": []}]}
    asked = request(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                    parallel_tool_calls=False,
                    input=[{"role": "user", "content": "Weather in Paris and Rome?"}, said,
                           CALL, CALL | {"call_id": "call_2", "arguments": '{"city": "Rome"}'},
                           {"type": "function_call_output", "call_id": "call_1",
                            "output": "sunny"},
                           {"type": "function_call_output", "call_id": "call_2", "output": [
                               {"type": "input_text", "text": "rain"}]},
                           CALL | {"call_id": "call_3"}])
    chat = asked.chat()
    assert chat["messages"] == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_3", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris"}'}}]}]
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather now.",
        "parameters": WEATHER["parameters"], "strict": True}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["parallel_tool_calls"] is False
    read = ChatRequest.model_validate(chat)
    assert read.forced_functions == [chat["tools"][0]["function"]]
    assert read.messages[1].for_template()["tool_calls"][0]["function"]["arguments"] == \
        {"city": "Paris"}  # as templates read a call
    for choice in ("auto", "none", "required"):
        assert request(tools=[WEATHER], tool_choice=choice).chat()["tool_choice"] == choice
    assert "tools" not in request().chat() and "tool_choice" not in request().chat()


def test_an_answers_calls_are_output_items_of_their_own() -> None:
    shape = Shape(request(tools=[WEATHER]), "abc", created_at=5)
    call = {"id": "call_9", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    answer = chat_answer("", "tool_calls")
    answer["choices"][0]["message"] |= {"content": None, "tool_calls": [call, call]}
    done = shape.answer(answer)
    assert done["status"] == "completed" and done["tools"] == [WEATHER]
    assert done["output"] == [
        {"type": "function_call", "id": f"fc_abc_{i}", "call_id": "call_9",
         "name": "get_weather", "arguments": '{"city": "Oslo"}', "status": "completed"}
        for i in range(2)]
    answer["choices"][0]["message"]["content"] = "Checking."
    said, *calls = shape.answer(answer)["output"]
    assert said["type"] == "message" and said["content"][0]["text"] == "Checking."
    assert [c["id"] for c in calls] == ["fc_abc_0", "fc_abc_1"]


def test_a_conversation_kept_goes_before_the_input_and_its_answers_read_back() -> None:
    """What a previous_response_id's conversation holds (its inputs as items, its answers'
    output items) goes before this input, after this request's instructions only; an
    answer's message and calls read back as the assistant's turn."""
    first = request(instructions="Be brief.", input="Weather in Paris?", tools=[WEATHER])
    assert first.input_items() == [{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "Weather in Paris?"}]}]
    call = {"id": "call_9", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    said = chat_answer("Looking.", "tool_calls")
    said["choices"][0]["message"]["tool_calls"] = [call]
    answer = Shape(first, "abc", 5, stored=True).answer(said)
    assert answer["store"] is True and answer["previous_response_id"] is None
    kept = first.input_items() + answer["output"]
    output = {"type": "function_call_output", "call_id": "call_9", "output": "sunny"}
    second = request(instructions="Be kind.", input=[output], tools=[WEATHER],
                     previous_response_id="resp_abc")
    assert second.input_items() == [output]
    messages = second.chat_after(kept).model_dump(exclude_none=True)["messages"]
    assert [(m["role"], m.get("content")) for m in messages] == [
        ("system", "Be kind."), ("user", "Weather in Paris?"), ("assistant", "Looking."),
        ("tool", "sunny")]
    assert messages[2]["tool_calls"][0]["id"] == "call_9"
    text = request(input="And tomorrow?").chat_after(kept).model_dump()["messages"]
    assert [m["role"] for m in text] == ["user", "assistant", "user"]
    assert text[-1]["content"] == "And tomorrow?"
    shown = Shape(second, "def", 6).answer(chat_answer("ok", "stop"))
    assert shown["previous_response_id"] == "resp_abc" and shown["store"] is False


def test_truncation_auto_drops_the_earliest_turns_that_do_not_fit_and_no_more() -> None:
    """A conversation past the context is answered from its latest turns that fit (the
    instructions kept), cut only where a user's turn starts, so no tool output is left
    without its call; where not even the last turn fits, nothing is."""
    def user(text: str) -> dict[str, Any]:
        return {"type": "message", "role": "user", "content": text}

    def assistant(text: str) -> dict[str, Any]:
        return {"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": text}]}

    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "c1", "output": "4"}
    earlier = [user("a" * 40), assistant("b" * 40), user("c" * 40), call, output,
               assistant("d" * 40), user("e" * 40), assistant("f" * 40)]
    assert turn_starts(earlier) == [2, 6]
    asked = request(instructions="Be brief.", input="g" * 40, truncation="auto")
    assert turn_starts([*earlier, *asked.input_items()]) == [2, 6, 8]
    measured: list[int] = []

    async def prompt_len(chat: ChatRequest) -> int:  # a character a token
        measured.append(len(chat.messages))
        return sum(len(m.content) if isinstance(m.content, str) else 0 for m in chat.messages)

    def kept(room: int) -> list[str] | None:
        chat = asyncio.run(latest_turns(asked, earlier, room, prompt_len))
        return None if chat is None else [m.role for m in chat.messages]

    whole = 9 + 7 * 40 + 1  # the instructions, seven messages of text, the tool's output
    assert kept(whole - 1) == ["system", "user", "assistant", "tool", "assistant", "user",
                               "assistant", "user"]  # the first turn dropped: one
    assert kept(9 + 3 * 40) == ["system", "user", "assistant", "user"]
    assert kept(9 + 40) == ["system", "user"]  # the input alone
    assert kept(9 + 39) is None
    measured.clear()
    assert kept(0) is None and not measured  # no room at all: nothing tokenized
    kept(whole - 1)
    assert len(measured) <= 2  # bisected over the three starts
    # a system or developer message among the items cut stays, as the instructions do
    guided = request(input=[{"role": "developer", "content": "Answer in French."},
                            user("h" * 40), assistant("i" * 40), user("j" * 40)],
                     truncation="auto")
    chat = asyncio.run(latest_turns(guided, [], 9 + 80, prompt_len))
    assert chat is not None and [(m.role, m.content) for m in chat.messages] == [
        ("developer", "Answer in French."), ("user", "j" * 40)]
    shown = Shape(asked, "abc", 5).answer({"choices": [{"message": {"content": "ok"},
                                                        "finish_reason": "stop"}],
                                           "usage": None})
    assert shown["truncation"] == "auto" and request()._chat is not None
    assert Shape(request(), "abc", 5).response("completed", [])["truncation"] == "disabled"
    with pytest.raises(ValidationError):
        request(truncation="sometimes")


def test_the_items_a_response_was_answered_from_are_listed_a_page_at_a_time() -> None:
    kept = [{"type": "message", "role": "user", "content": "hi"},
            {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": "Hello."}]},
            {"type": "function_call", "id": "fc_1_0", "call_id": "c", "name": "f",
             "arguments": "{}", "status": "completed"},
            {"type": "function_call_output", "call_id": "c", "output": "4"}]
    page = item_list(kept, "resp_abc")  # newest first, as OpenAI lists them
    assert [item["id"] for item in page["data"]] == ["item_3_abc", "fc_1_0", "msg_1",
                                                     "item_0_abc"]
    assert (page["first_id"], page["last_id"], page["has_more"]) == ("item_3_abc",
                                                                     "item_0_abc", False)
    said = page["data"][-1]
    assert said == {"id": "item_0_abc", "status": "completed", "type": "message",
                    "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
    assert page["data"][2]["content"] == [{"type": "output_text", "text": "Hello.",
                                           "annotations": []}]
    first = item_list(kept, "resp_abc", order="asc", limit=3)
    assert [item["id"] for item in first["data"]] == ["item_0_abc", "msg_1", "fc_1_0"]
    assert first["has_more"] is True
    rest = item_list(kept, "resp_abc", order="asc", limit=3, after=first["last_id"])
    assert [item["id"] for item in rest["data"]] == ["item_3_abc"] and not rest["has_more"]
    assert item_list(kept, "resp_abc", after="item_0_abc")["data"] == []
    for wrong in ({"order": "up"}, {"limit": 0}, {"limit": 101}, {"after": "item_9"}):
        with pytest.raises(ParamError) as refused:
            item_list(kept, "resp_abc", **wrong)  # type: ignore[arg-type]
        assert refused.value.param == next(iter(wrong))
    cut = item_list([kept[1] | {"status": "incomplete"}], "resp_abc")
    assert cut["data"][0]["status"] == "incomplete"


def test_a_stream_is_kept_before_its_last_event_which_says_whether_it_was() -> None:
    shape = Shape(request(stream=True), "abc", 5, stored=True)
    kept: list[dict[str, Any]] = []

    async def keep(response: dict[str, Any]) -> None:
        kept.append(json.loads(json.dumps(response)))  # as it was when kept
        response["store"] = len(kept) == 1  # the second time, Redis fails

    async def read() -> list[str]:
        return [e async for e in events(shape, chunks_of(delta("Hi"), delta(finish="stop")),
                                        keep)]

    seen = [json.loads(e.split("data: ", 1)[1]) for e in asyncio.run(read())]
    assert kept[0] == seen[-1]["response"] and kept[0]["output"][0]["content"][0]["text"] \
        == "Hi"
    again = [json.loads(e.split("data: ", 1)[1]) for e in asyncio.run(read())]
    assert again[-1]["response"]["store"] is False and len(kept) == 2


def chat_answer(text: str, finish: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": finish}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}


def test_the_answer_says_whether_its_limit_cut_it() -> None:
    shape = Shape(request(metadata={"k": "v"}, max_output_tokens=3), "abc", created_at=5)
    done = shape.answer(chat_answer("Hello.", "stop"))
    assert done["id"] == "resp_abc" and done["status"] == "completed"
    assert done["incomplete_details"] is None and done["metadata"] == {"k": "v"}
    assert done["output"] == [{"type": "message", "id": "msg_abc", "status": "completed",
                               "role": "assistant", "content": [{
                                   "type": "output_text", "text": "Hello.",
                                   "annotations": [], "logprobs": []}]}]
    assert done["usage"] == {"input_tokens": 7, "input_tokens_details": {
                                 "cached_tokens": 0, "cache_write_tokens": 0},
                             "output_tokens": 3,
                             "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": 10}
    assert done["store"] is False  # nothing is kept to be fetched later
    cut = shape.answer(chat_answer("Hel", "length"))
    assert cut["status"] == cut["output"][0]["status"] == "incomplete"
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}
    scored = chat_answer("Hi", "stop")
    scored["choices"][0]["logprobs"] = {"content": [token("Hi", -0.5)]}
    assert shape.answer(scored)["output"][0]["content"][0]["logprobs"] == [token("Hi", -0.5)]


def token(text: str, logprob: float) -> dict[str, Any]:
    """A token's entry as a chat answer's logprobs carry it."""
    return {"token": text, "logprob": logprob, "bytes": list(text.encode()),
            "top_logprobs": []}


async def chunks_of(*chunks: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    for chunk in chunks:
        yield chunk


def delta(text: str | None = None, finish: str | None = None,
          tokens: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    said = {} if text is None else {"content": text}
    return {"choices": [{"index": 0, "delta": said, "finish_reason": finish,
                         "logprobs": None if tokens is None else {"content": tokens}}]}


def streamed(shape: Shape, *chunks: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Each event's name and data, checked to name its type."""
    async def read() -> list[str]:
        return [e async for e in events(shape, chunks_of(*chunks))]

    out = []
    for raw in asyncio.run(read()):
        name_line, data_line, *rest = raw.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: ")
        assert rest == ["", ""]  # one event, ended by a blank line
        data = json.loads(data_line.removeprefix("data: "))
        assert data["type"] == name_line.removeprefix("event: ")
        out.append((data["type"], data))
    return out


def test_a_stream_opens_adds_each_piece_and_closes_in_order() -> None:
    shape = Shape(request(stream=True), "abc", 5)
    usage = {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    seen = streamed(shape, {"choices": [{"index": 0, "delta": {"role": "assistant",
                                                               "content": ""},
                                         "finish_reason": None}]},
                    delta("Hel"), delta("lo"), delta(finish="stop"),
                    {"choices": [], "usage": usage})
    assert [name for name, _ in seen] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [data["sequence_number"] for _, data in seen] == list(range(len(seen)))
    assert [data["delta"] for name, data in seen if name.endswith(".delta")] == ["Hel", "lo"]
    assert seen[6][1]["text"] == seen[7][1]["part"]["text"] == "Hello"
    assert seen[2][1]["item"]["status"] == "in_progress" and seen[2][1]["item"]["content"] == []
    final = seen[-1][1]["response"]
    assert final["status"] == "completed" and final["usage"]["total_tokens"] == 6
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert all(data["item_id"] == "msg_abc" for name, data in seen if "item_id" in data)


def test_a_streams_logprobs_go_with_the_text_they_score() -> None:
    """A token whose text has not come yet (held back as a stop string may begin there, or
    part of a character) has its logprob shown with the next piece of text; all of them in
    the text's done events."""
    shape = Shape(request(stream=True, include=["message.output_text.logprobs"]), "abc", 5)
    a, b, c = token("Hel", -0.1), token("l", -0.2), token("o", -0.3)
    seen = streamed(shape, delta("Hel", tokens=[a]), delta(tokens=[b]),
                    delta("lo", tokens=[c]), delta(finish="stop"))
    assert [data["logprobs"] for name, data in seen if name.endswith(".delta")] == [[a],
                                                                                    [b, c]]
    done = dict(seen)
    assert done["response.output_text.done"]["logprobs"] == [a, b, c]
    assert done["response.content_part.done"]["part"]["logprobs"] == [a, b, c]
    assert done["response.completed"]["response"]["output"][0]["content"][0]["logprobs"] == \
        [a, b, c]
    # tokens left with no text after the last piece (a length cut inside a character)
    # are in the done events only
    seen = streamed(shape, delta("Hel", tokens=[a]), delta(finish="length", tokens=[b]))
    assert [data["logprobs"] for name, data in seen if name.endswith(".delta")] == [[a]]
    assert dict(seen)["response.output_text.done"]["logprobs"] == [a, b]


def calls_chunk(*calls: dict[str, Any], text: str | None = None) -> dict[str, Any]:
    """A chat stream's chunk of calls, as routes.chunk_events sends them."""
    said = {"tool_calls": [{"index": i} | c for i, c in enumerate(calls)]}
    return {"choices": [{"index": 0, "delta": said | ({} if text is None else
                                                      {"content": text}),
                         "finish_reason": None}]}


def test_a_streams_calls_come_after_its_text_each_an_item_given_whole() -> None:
    """The message is added at the first text and done before the calls; each call is
    added, its arguments given, and done, at the output index after the items before it;
    an answer of calls alone has no message."""
    shape = Shape(request(stream=True, tools=[WEATHER]), "abc", 5)
    first = {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    second = {"id": "call_2", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    seen = streamed(shape, delta("Sure."), calls_chunk(first, second),
                    delta(finish="tool_calls"))
    call_events = ["response.output_item.added", "response.function_call_arguments.delta",
                   "response.function_call_arguments.done", "response.output_item.done"]
    assert [name for name, _ in seen] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", *call_events, *call_events, "response.completed"]
    assert [data["sequence_number"] for _, data in seen] == list(range(len(seen)))
    added = [data for name, data in seen if name == "response.output_item.added"]
    assert [(a["output_index"], a["item"]["type"], a["item"].get("arguments")) for a in added] \
        == [(0, "message", None), (1, "function_call", ""), (2, "function_call", "")]
    given = [data for name, data in seen if name.startswith("response.function_call")]
    assert [(g["output_index"], g["item_id"], g.get("delta", g.get("arguments")))
            for g in given] == [(1, "fc_abc_0", '{"city": "Oslo"}')] * 2 + \
        [(2, "fc_abc_1", '{"city": "Rome"}')] * 2
    final = seen[-1][1]["response"]
    assert [item["type"] for item in final["output"]] == ["message", "function_call",
                                                          "function_call"]
    assert final["output"][2]["call_id"] == "call_2" and final["status"] == "completed"
    alone = streamed(shape, calls_chunk(first), delta(finish="tool_calls"))
    assert [name for name, _ in alone] == ["response.created", "response.in_progress",
                                           *call_events, "response.completed"]
    assert alone[2][1]["output_index"] == 0
    assert alone[-1][1]["response"]["output"] == [shape.call(first, 0)]
    # an answer with neither text nor calls is an empty message, as without tools
    empty = streamed(shape, delta(finish="stop"))
    assert empty[-1][1]["response"]["output"][0]["content"][0]["text"] == ""
    assert [name for name, _ in empty][2:4] == ["response.output_item.added",
                                                "response.content_part.added"]


def test_the_message_holds_the_text_before_the_calls_and_its_tokens_only() -> None:
    """White space before a call is no message, streamed or not; the message's logprobs
    are its text's tokens, not the call's after it; calls cut by the limit are incomplete."""
    shape = Shape(request(stream=True, tools=[WEATHER],
                          include=["message.output_text.logprobs"]), "abc", 5)
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    blank, opening, name = token("\n", -0.1), token("<tool_call>", -0.2), token("{", -0.3)
    alone = streamed(shape, delta("\n", tokens=[blank]), delta(tokens=[opening, name]),
                     calls_chunk(call), delta(finish="tool_calls"))
    assert [item["type"] for item in alone[-1][1]["response"]["output"]] == ["function_call"]
    assert not [name for name, _ in alone if "output_text" in name]
    sure, stop = token("Sure", -0.4), token(".", -0.5)
    seen = streamed(shape, delta("Sure", tokens=[sure]), delta(".", tokens=[stop]),
                    delta(tokens=[blank, opening, name]), calls_chunk(call),
                    delta(finish="tool_calls"))
    done = dict(seen)
    assert done["response.output_text.done"]["logprobs"] == [sure, stop]
    assert done["response.completed"]["response"]["output"][0]["content"][0]["logprobs"] == \
        [sure, stop]
    # not streamed: the chat's message, its text stripped, and every token's logprobs
    answer = chat_answer("Sure.", "tool_calls")
    answer["choices"][0]["message"]["tool_calls"] = [call]
    answer["choices"][0]["logprobs"] = {"content": [sure, stop, blank, opening, name]}
    said, made = shape.answer(answer)["output"]
    assert said["content"][0]["logprobs"] == [sure, stop, blank]
    assert made["status"] == "completed"
    answer["choices"][0]["finish_reason"] = "length"
    assert shape.answer(answer)["output"][1]["status"] == "incomplete"
    # white space alone is a message (as the answer without tools)
    spaced = streamed(shape, delta(" ", tokens=[blank]), delta(finish="stop"))
    assert dict(spaced)["response.output_text.done"]["text"] == " "
    assert [d["delta"] for n, d in spaced if n == "response.output_text.delta"] == [" "]


def test_a_stream_cut_by_its_limit_ends_incomplete_and_one_that_fails_as_failed() -> None:
    shape = Shape(request(stream=True, max_output_tokens=1), "abc", 5)
    cut = streamed(shape, delta("Hel", "length"))
    assert cut[-1][0] == "response.incomplete"
    assert cut[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut[-2][1]["item"]["status"] == "incomplete"
    failed = streamed(shape, delta("Hel"), {"error": {"message": "the request failed: gone",
                                                       "type": "server_error"}})
    assert [name for name, _ in failed][-2:] == ["response.output_text.delta",
                                                  "response.failed"]
    assert failed[-1][1]["response"]["error"] == {"code": "server_error",
                                                   "message": "the request failed: gone"}
