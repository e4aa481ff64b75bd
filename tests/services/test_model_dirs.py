"""The disaggregated stack serves a Hugging Face model directory end to end, under the
directory's name; a checkpoint the processes cannot read stops them with its reason, not a
traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from distserve.cli import main as distserve
from services.launcher import Stack
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from tests.model_dirs import linked_with
from tests.services.conftest import greedy, metric_when, start_stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
NAME = "SmolLM2-135M-Instruct"


# as Mistral's and Llama 2's templates do, this one refuses some messages
REFUSING = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system messages') }}" \
           "{% endif %}"
# and it shows tools as Qwen's do, asking for Hermes' <tool_call> blocks (none without tools)
HERMES = ("{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools> Call "
          "one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>\n{% endif %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """The run's SmolLM2 directory with the refusing, tool-showing template (its other files
    linked)."""
    template = (smollm2_dir / "chat_template.jinja").read_text()
    return linked_with(smollm2_dir, tmp_path_factory.mktemp("models") / NAME,
                       {"chat_template.jinja": REFUSING + HERMES + template})


@pytest.fixture(scope="module")
def dir_stack(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("stack"), prefill=1, decode=1, model=str(model_dir))
    yield s
    s.stop()


def test_the_stack_serves_a_model_directory(dir_stack: Stack, model_dir: Path) -> None:
    engine = Engine(EngineConfig(model=str(model_dir)))
    assert engine.tokenizer is not None
    c = openai.OpenAI(base_url=f"{dir_stack.url}/v1", api_key="unused", timeout=120)
    assert [m.id for m in c.models.list().data] == [NAME]
    prompt = "The capital of France is"
    expected = greedy(engine, engine.tokenizer.encode(prompt), 16)
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=NAME, prompt=prompt, max_tokens=16, temperature=0, stream=True) if ch.choices)
    assert streamed == expected and len(expected) > 10
    messages = [{"role": "user", "content": "Name three colors."}]
    chat_ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages))
    r = c.chat.completions.create(model=NAME, messages=messages,  # type: ignore[arg-type]
                                  max_tokens=20, temperature=0)
    assert r.choices[0].message.content == greedy(engine, chat_ids, 20)
    # messages the template refuses: a 400 in OpenAI's shape naming why, not a 500
    refused = httpx.post(f"{dir_stack.url}/v1/chat/completions", timeout=30, json={
        "model": NAME, "messages": [{"role": "system", "content": "Be brief."}, *messages]})
    assert refused.status_code == 400
    assert "no system messages" in refused.json()["error"]["message"]
    # the KV crossed from the prefill to the decode instance (a CI run read the first
    # request's count only: the second's heartbeat had not yet come)
    def pulled(reading: dict[str, float]) -> float:
        return sum(v for i, v in reading.items() if i.startswith("decode"))

    assert pulled(metric_when(dir_stack.url, "ds_kv_transfer_requests_total",
                              lambda r: pulled(r) >= 2)) >= 2
    wrong = httpx.post(f"{dir_stack.url}/v1/completions", timeout=30,
                       json={"model": "smollm2-135m", "prompt": "hi", "max_tokens": 2})
    assert wrong.status_code == 404  # as OpenAI answers a model it does not have
    assert wrong.json()["error"]["code"] == "model_not_found" and NAME in wrong.text


def test_a_checkpoint_the_processes_cannot_read_stops_them_with_its_reason(
        model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "no-tokenizer"
    bad.mkdir()
    for file in model_dir.iterdir():
        if file.name != "tokenizer.json":
            os.symlink(file, bad / file.name)
    reason = "has no tokenizer.json"
    # a worker started on it: exit code 2, the reason in its log, no traceback
    done = subprocess.run([sys.executable, "-m", "services.prefill"], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "DS_MODEL": str(bad)})
    assert done.returncode == 2
    assert reason in done.stderr and "Traceback" not in done.stderr
    # `distserve up` checks the model before starting anything
    with pytest.raises(SystemExit) as exit_:
        distserve(["up", "--model", str(bad), "--run-dir", str(tmp_path / "runs")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert reason in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city"], "additionalProperties": False,
    "properties": {"city": {"type": "string", "maxLength": 30}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "required": ["zone"], "properties": {"zone": {"type": "string"}}}}}


def test_a_required_tool_call_is_made(dir_stack: Stack) -> None:
    """tool_choice that requires a call, on a model whose template teaches Hermes' calls
    (SmolLM2, which left alone would rarely make one): the answer is the call, of the
    function named or of one offered, its arguments valid JSON of the function's
    parameters, streamed or not."""
    c = openai.OpenAI(base_url=f"{dir_stack.url}/v1", api_key="unused", timeout=120)
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = c.chat.completions.create(
        model=NAME, messages=asked, tools=[WEATHER, CLOCK],  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0, max_tokens=60)
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0].function  # type: ignore[union-attr]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    streamed = c.chat.completions.create(
        model=NAME, messages=asked, tools=[WEATHER, CLOCK],  # type: ignore[arg-type]
        tool_choice="required", temperature=1.0, seed=2, max_tokens=300, stream=True,
        parallel_tool_calls=False)
    calls = [t for chunk in streamed if chunk.choices
             for t in chunk.choices[0].delta.tool_calls or []]
    assert len(calls) == 1 and calls[0].function is not None
    assert calls[0].function.name in ("get_weather", "get_time")
    json.loads(calls[0].function.arguments or "")


def function_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A chat's tool in the Responses API's form: the function's spec beside its type."""
    return {"type": "function"} | tool["function"]


def test_an_agent_calls_a_function_and_reads_its_output_through_the_responses_api(
        dir_stack: Stack) -> None:
    """The openai client's `responses.create` and `responses.stream` with function tools, as
    an agent drives them: the call the answer must make is an output item of its own (the
    client's stream helper assembles it from the events); the answer's items and the call's
    output sent back as input, or the output alone after the answer kept, get the answer
    the same conversation gets as a chat."""
    c = openai.OpenAI(base_url=f"{dir_stack.url}/v1", api_key="unused", timeout=120)
    asked = "What is the weather in Paris?"
    tools: Any = [function_tool(WEATHER), function_tool(CLOCK)]
    answer = c.responses.create(model=NAME, input=asked, tools=tools, temperature=0,
                                tool_choice={"type": "function", "name": "get_weather"},
                                max_output_tokens=60)
    assert answer.status == "completed" and [item.type for item in answer.output] == \
        ["function_call"]
    call = answer.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    assert set(json.loads(call.arguments)) == {"city"}
    with c.responses.stream(model=NAME, input=asked, tools=tools, tool_choice="required",
                            temperature=0, max_output_tokens=60,
                            parallel_tool_calls=False) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds
    assert [item.type for item in final.output] == ["function_call"]
    assert final.output[0].name in ("get_weather", "get_time")  # type: ignore[union-attr]
    json.loads(final.output[0].arguments)  # type: ignore[union-attr]

    sent_back: Any = [{"role": "user", "content": asked},
                      *(item.model_dump(exclude_none=True) for item in answer.output),
                      {"type": "function_call_output", "call_id": call.call_id,
                       "output": "Sunny, 21 C."}]
    followed = c.responses.create(model=NAME, input=sent_back, tools=tools,
                                  temperature=0, max_output_tokens=24)
    as_chat = c.chat.completions.create(
        model=NAME, tools=[WEATHER, CLOCK], temperature=0, max_tokens=24,  # type: ignore
        messages=[{"role": "user", "content": asked},
                  {"role": "assistant", "tool_calls": [{
                      "id": call.call_id, "type": "function",
                      "function": {"name": call.name, "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C."}])
    chat_said = as_chat.choices[0].message  # text, or (auto) calls, the same either way
    assert followed.output_text == (chat_said.content or "")
    assert [item.name for item in followed.output if item.type == "function_call"] == \
        [tc.function.name for tc in chat_said.tool_calls or []]  # type: ignore[union-attr]
    assert followed.usage is not None and as_chat.usage is not None
    assert followed.usage.input_tokens == as_chat.usage.prompt_tokens
    # as an agent's loop goes on from the answer kept: its call's output alone as input
    went_on = c.responses.create(model=NAME, previous_response_id=answer.id, tools=tools,
                                 temperature=0, max_output_tokens=24, input=sent_back[-1:])
    assert went_on.output_text == followed.output_text
    assert went_on.usage is not None and went_on.usage.input_tokens == \
        followed.usage.input_tokens
