"""The gateway's pure pieces: its view of the instances, the in-flight ledger, request
timing, the OpenAI request models, and the door (API keys, body limit)."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from services.gateway.affinity import PrefixAffinity
from services.gateway.app import Door, create_app
from services.gateway.gateway import Gateway, GatewaySettings, Target
from services.gateway.ledger import Ledger, Overloaded
from services.gateway.metrics import INSTANCE_TOTALS, Metrics
from services.gateway.openai_api import (
    APIError,
    ChatRequest,
    CompletionRequest,
    TokenLogprob,
    completion_logprobs,
)
from services.gateway.routes import (
    Call,
    choice_ids,
    choice_seeds,
    collect,
    failed,
    interleaved,
)
from services.gateway.stored import ResponseStore, owner_of
from services.gateway.stream import GaveUp, Lost, Relay
from services.gateway.timing import RequestTiming
from services.gateway.view import InstanceView, stuck_for
from services.supervisor import free_port
from shared.engine.engine import TextState
from shared.engine.meta import read_tokenizer
from shared.messages import Sampling, TokenChunk
from shared.state import InstanceInfo, redis_client
from tests.tokenizers import spm_like


def info(instance_id: str, role: str = "prefill", steps: int = 0) -> InstanceInfo:
    return InstanceInfo(instance_id=instance_id, role=role, steps=steps)  # type: ignore[arg-type]


def test_view_drops_an_instance_silent_next_to_its_peers() -> None:
    view = InstanceView(ttl_s=2.0)
    view.observe(info("p0"), 0.0)
    view.observe(info("d0", "decode"), 0.0)
    for t in (1.0, 2.0, 3.0):  # d0 keeps beating, p0 fell silent at 0
        view.observe(info("d0", "decode"), t)
    assert view.get("p0", 3.0) is None
    assert [i.instance_id for i in view.instances("decode", 3.0)] == ["d0"]


def test_view_does_not_take_a_busy_gateway_for_dead_instances() -> None:
    view = InstanceView(ttl_s=2.0)
    view.observe(info("p0"), 0.0)
    view.observe(info("d0", "decode"), 0.0)
    # the gateway's loop was busy for 5 s: nothing handled, nobody silent next to a peer
    assert view.get("p0", 5.0) is not None and view.get("d0", 5.0) is not None
    # but when everybody is quiet for longer than the hard TTL, nobody is live
    assert view.instances("prefill", 10.5) == []


def test_ledger_admits_up_to_its_limit_and_counts_per_instance() -> None:
    ledger = Ledger()
    tickets = [ledger.admit(limit=2) for _ in range(2)]
    with pytest.raises(Overloaded):
        ledger.admit(limit=2)
    tickets[0].release()
    tickets[0].release()  # idempotent
    assert ledger.admitted == 1
    pair, worker = ledger.book("p0", "d0"), ledger.book("c0", "")
    assert ledger.per_instance() == {"p0": 1, "d0": 1, "c0": 1}
    assert ledger.queued == {"c0": 1}  # a colocated request awaits its first token
    pair.prefilled()
    worker.prefilled()
    worker.prefilled()  # idempotent
    assert ledger.per_instance() == {"p0": 0, "d0": 1, "c0": 1}
    assert ledger.queued == {"c0": 0}
    pair.settle()
    pair.settle()  # idempotent
    tickets[1].booking = worker
    assert ledger.per_instance() == {"p0": 0, "d0": 0, "c0": 1}
    written = ledger.per_instance()
    assert written == {"p0": 0, "d0": 0, "c0": 1}
    ledger.forget_idle(written)
    assert ledger.per_instance() == {"c0": 1}
    tickets[1].release()  # the request ended before any stream settled its booking
    assert (ledger.admitted, ledger.per_instance()) == (0, {"c0": 0})


def test_timing_feeds_ttft_tpot_and_the_event() -> None:
    timing = RequestTiming(prompt_tokens=5, start=10.0)
    timing.tokens(1, now=10.5)
    timing.tokens(0, now=10.7)  # an empty chunk is no token
    timing.tokens(2, now=11.5)
    assert timing.ttft_s == pytest.approx(0.5)
    assert timing.tpot_s == pytest.approx(0.5)  # 1 s over the 2 tokens after the first
    timing.cached_tokens = 4  # its prefill found 4 of its 5 prompt tokens cached
    done = timing.done("stop")
    assert (done.output_tokens, done.ttft_s, done.outcome) == (3, pytest.approx(0.5), "stop")
    assert done.cached_tokens == 4


@pytest.mark.parametrize("body", [
    {"model": "m", "messages": [{"role": "user", "content": "Hi \ud800"}]},
    {"model": "m", "messages": [{"role": "user", "content": [{"type": "text",
                                                              "text": "\udfff"}]}]},
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": "x" * 257},
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": ["a"] * 5},
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": "\ud800"},
])
def test_chat_requests_refuse_what_cannot_be_served(body: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        ChatRequest.model_validate(body)


@pytest.mark.parametrize(("message", "refused"), [
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
     "reads text only: a content part of type 'image_url'"),
    ({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio"}]},
     "'input_audio'"),
    ({"role": "user"}, "Field required"),
    ({"role": "tool", "content": None}, "valid string"),
    ({"role": "function", "content": "x"}, "does not match any of the expected tags"),
])
def test_a_message_that_cannot_be_read_is_refused_by_name(message: dict[str, object],
                                                         refused: str) -> None:
    with pytest.raises(ValidationError, match=refused):
        ChatRequest.model_validate({"model": "m", "messages": [message]})


@pytest.mark.parametrize(("extra", "refused"), [
    ({"response_format": {"type": "xml"}}, "'text', 'json_object' or 'json_schema'"),
    ({"response_format": {"type": "json_schema"}}, "needs its json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
     "should match pattern"),
    ({"structured_outputs": {}}, "takes one of json, regex, choice, grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, r"\(2 given\)"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}},
     "response_format and guided_regex each hold the answer to a format"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True},
     "ignore_eos would run the answer past the end of its format"),
    ({"response_format": {"type": "json_object"},
      "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools and response_format at once are not served"),
    ({"tool_choice": "required"}, "tool_choice required needs tools to call"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "not among the tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "g"}},
      "tools": [{"type": "function", "function": {"name": "f"}}]}, "names 'g', which is not"),
    ({"tool_choice": "required", "ignore_eos": True,
      "tools": [{"type": "function", "function": {"name": "f"}}]}, "past the call"),
    ({"tool_choice": "always", "tools": [{"type": "function", "function": {"name": "f"}}]},
     'tool_choice takes "auto", "none", "required"'),
    ({"tool_choice": "required", "response_format": {"type": "json_object"},
      "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools and response_format"),
    ({"logit_bias": {"x": 1}}, "token ids"),
    ({"logit_bias": {"1": 101}}, "less than or equal to 100"),
    ({"logit_bias": {"²": 1}}, "token ids"),  # a digit to str.isdigit, not to int()
    ({"logit_bias": {"1" * 5000: 1}}, "token ids"),
    ({"logit_bias": {"0": 100, "00": 100}}, "names a token twice"),
])
def test_what_would_mislead_if_ignored_is_refused(extra: dict[str, object],
                                                   refused: str) -> None:
    with pytest.raises(ValidationError, match=refused):
        ChatRequest.model_validate({"model": "m", "messages": [
            {"role": "user", "content": "hi"}], **extra})
    for fine in ({"response_format": {"type": "text"}}, {"tool_choice": "auto"},
                 {"response_format": {"type": "json_object"}},
                 {"response_format": {"type": "json_schema", "json_schema": {
                     "name": "n", "schema": {"type": "object", "if": {"type": "object"}}}}},
                 {"tool_choice": "none"},
                 {"tools": [{"type": "function", "function": {"name": "f"}}]}):
        ChatRequest.model_validate({"model": "m", "messages": [
            {"role": "user", "content": "hi"}], **fine})


@pytest.mark.parametrize(("extra", "refused"), [
    ({"stream_options": {"include_usage": True}}, "goes with stream: true"),
    ({"stream": False, "stream_options": {}}, "goes with stream: true"),
    ({"best_of": 3}, "best_of is not served"),
    ({"best_of": 3, "n": 2}, "best_of is not served"),
    ({"best_of": 0}, "greater than or equal to 1"),
    ({"suffix": "}"}, "suffix"),
])
def test_fields_of_what_is_not_served_are_refused(extra: dict[str, object],
                                                  refused: str) -> None:
    with pytest.raises(ValidationError, match=refused):
        CompletionRequest.model_validate({"model": "m", "prompt": "hi", **extra})
    for fine in ({"best_of": 1}, {"best_of": 2, "n": 2}, {"suffix": ""},
                 {"stream": True, "stream_options": {"include_usage": True}}):
        CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fine})
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for deprecated in ({"functions": [{"name": "f"}]}, {"function_call": "auto"},
                       {"function_call": {"name": "f"}}):
        with pytest.raises(ValidationError, match="send tools"):
            ChatRequest.model_validate(chat | deprecated)
    for fine in ({"functions": []}, {"function_call": "none"}, {"modalities": ["text"]}):
        ChatRequest.model_validate(chat | fine)
    for audio in ({"modalities": ["text", "audio"]},
                  {"modalities": ["text", "audio"], "audio": {"voice": "alloy",
                                                               "format": "wav"}},
                  {"audio": {"voice": "alloy", "format": "wav"}}):
        with pytest.raises(ValidationError, match="audio output is not served"):
            ChatRequest.model_validate(chat | audio)


def test_an_explicit_null_is_the_default() -> None:
    """The openai client sends null for a None: every optional parameter reads it as left
    out; one that takes null keeps it (max_tokens null: as many as fit)."""
    nulls = {name: None for name in ChatRequest.model_fields if name not in ("model",
                                                                             "messages")}
    said = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert ChatRequest.model_validate(said | nulls) == ChatRequest.model_validate(said)
    nulls = {name: None for name in CompletionRequest.model_fields if name not in ("model",
                                                                                   "prompt")}
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "hi"} | nulls)
    assert completion.max_tokens is None and completion.temperature == 1.0
    assert completion.logprobs is None and completion.echo is False and completion.n == 1
    with pytest.raises(ValidationError, match="Field required"):  # what has no default
        ChatRequest.model_validate(said | {"model": None})


def test_the_legacy_top_logprobs_hold_the_chosen_token() -> None:
    """OpenAI's legacy block shows the chosen token among each position's likeliest, k + 1
    of them where it is not one of the k."""
    def t(text: str, logprob: float | None) -> TokenLogprob:
        return TokenLogprob(text, text.encode(), logprob)

    block = completion_logprobs([t("The", None), t(" cat", -3.0), t(" sat", -0.5)],
                                [None, [t(" dog", -0.2)], [t(" sat", -0.5)]], [0, 3, 7])
    assert block["top_logprobs"] == [None, {" dog": -0.2, " cat": -3.0}, {" sat": -0.5}]
    assert block["tokens"] == ["The", " cat", " sat"]
    assert block["token_logprobs"] == [None, -3.0, -0.5]
    assert completion_logprobs([t("a", -1.0)], None, [0])["top_logprobs"] is None


def test_a_tool_call_names_its_function_by_a_string() -> None:
    with pytest.raises(ValidationError, match="valid string"):
        ChatRequest.model_validate({"model": "m", "messages": [{"role": "assistant",
                                    "tool_calls": [{"function": {"name": 5}}]}]})


def test_a_long_prompts_scores_go_in_parts_and_come_together() -> None:
    """Each part under NATS's message limit, all but the last ahead of the token; the
    gateway's choice takes them by position, the first copy kept, and its relay passes a
    part on without taking the request for prefilled."""
    from services.gateway.routes import Call
    from services.runtime import SCORES_PER_CHUNK, prompt_part
    from shared.engine.request import Draw

    scores = [Draw(t, -float(t), ((t, -float(t)), (0, -9.0))) for t in range(2500)]
    parts = [prompt_part(scores, start) for start in range(0, 2500, SCORES_PER_CHUNK)]
    assert [p["prompt_from"] for p in parts] == [0, 1024, 2048]
    assert all(len(TokenChunk(request_id="r", **p).model_dump_json()) < 1 << 19
               for p in parts)
    call = Call.__new__(Call)
    call.scores, call.cached_tokens = {}, 0
    for p in reversed(parts):  # in any order, and twice: the first copy stays
        call.take(TokenChunk(request_id="r", **p))
    call.take(TokenChunk(request_id="r", prompt_from=0, prompt_logprobs=[1.0],
                         prompt_top_logprobs=[[]]))
    assert sorted(call.scores) == list(range(2500))
    assert call.scores[2499] == (-2499.0, [(2499, -2499.0), (0, -9.0)])
    assert call.scores[0][0] == 0.0  # not the second copy's 1.0
    relay = Relay(None, InstanceView(2.0), "r", "p0", "d0", 60.0)  # type: ignore[arg-type]
    assert relay.accept(TokenChunk(request_id="r", source="p0", **parts[0]))
    assert not relay.prefilled and relay.output_ids == []
    with pytest.raises(Lost, match="scores of prompt tokens 1024-2047"):  # one went missing
        relay.accept(TokenChunk(request_id="r", source="p0", token_ids=[5], **parts[2]))
    relay.retarget("p1", "d0", prefilled=False)  # the next attempt scores from the start
    assert relay.accept(TokenChunk(request_id="r", source="p1", attempt=relay.attempt,
                                   **parts[0]))


def test_an_agents_history_goes_to_the_template_as_the_client_sent_it() -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 1}'}}
    req = ChatRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "1 + "},
                                     {"type": "text", "text": "1?"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2"},
        {"role": "assistant"}]})
    assert [m.for_template() for m in req.messages] == [
        {"role": "user", "content": "1 + 1?"},
        {"role": "assistant", "content": "", "tool_calls": [  # the arguments as an object
            {"id": "call_1", "type": "function",
             "function": {"name": "add", "arguments": {"a": 1}}}]},
        {"role": "tool", "content": "2", "tool_call_id": "call_1"},
        {"role": "assistant", "content": ""}]


def test_choices_are_requests_of_their_own_the_first_as_a_single_one() -> None:
    assert choice_ids("ab12", 3) == ["ab12", "ab12c1", "ab12c2"]
    assert choice_seeds(7, 3) == [7, 8, 9]
    assert ChatRequest.model_validate({"model": "m", "n": 128, "messages": [
        {"role": "user", "content": "hi"}]}).n == 128
    for n in (0, 129):
        with pytest.raises(ValidationError):
            CompletionRequest(model="m", prompt="hi", n=n)


class FakeChoice:
    """A choice whose chunks come at given moments; it says whether its stream was closed
    (as the gateway's generator cancels a request on its instances when closed)."""

    def __init__(self, index: int, delays: list[float], gives_up: bool = False) -> None:
        self.index, self.delays, self.gives_up = index, delays, gives_up
        self.closed = False

    async def chunks(self):  # type: ignore[no-untyped-def]
        try:
            for i, delay in enumerate(self.delays):
                await asyncio.sleep(delay)
                yield TokenChunk(request_id=str(self.index), token_ids=[i], text=f"{i}")
            if self.gives_up:
                raise GaveUp("no instance left")
        finally:
            self.closed = True


def read(choices: list[FakeChoice], stop_after: int | None = None
         ) -> tuple[list[tuple[int, str]], list[bool]]:
    """What the stream gave, and which choices were closed 50 ms after it ended (still
    inside the event loop: asyncio.run would cancel what is left on its way out)."""
    async def go() -> tuple[list[tuple[int, str]], list[bool]]:
        seen: list[tuple[int, str]] = []
        stream = interleaved(choices)  # type: ignore[arg-type]
        try:
            async for call, chunk in stream:
                seen.append((call.index, chunk.text))
                if len(seen) == stop_after:
                    break
        except GaveUp:
            seen.append((-1, "gave up"))
        await stream.aclose()
        await asyncio.sleep(0.05)  # the readers' tasks run their cleanup
        return seen, [c.closed for c in choices]

    return asyncio.run(go())


def test_choices_stream_interleaved_as_their_tokens_come() -> None:
    choices = [FakeChoice(0, [0.0, 0.3, 0.3]), FakeChoice(1, [0.05, 0.05, 0.05])]
    seen, closed = read(choices)
    assert [text for index, text in seen if index == 0] == ["0", "1", "2"]
    assert [text for index, text in seen if index == 1] == ["0", "1", "2"]
    assert seen[0] == (0, "0") and seen[-1] == (0, "2")  # the other's came between
    assert closed == [True, True]


def test_a_stream_that_ends_early_closes_every_choice() -> None:
    choices = [FakeChoice(0, [0.0] + [0.5] * 9), FakeChoice(1, [0.01] + [0.5] * 9)]
    seen, closed = read(choices, stop_after=2)
    assert len(seen) == 2 and closed == [True, True]  # cancelled on their instances


def test_one_choice_that_gives_up_ends_the_stream_and_closes_the_others() -> None:
    choices = [FakeChoice(0, [0.0, 0.01], gives_up=True), FakeChoice(1, [0.005] + [1.0] * 9)]
    seen, closed = read(choices)
    assert seen[-1] == (-1, "gave up") and closed == [True, True]


def test_a_request_that_gave_up_gets_503_with_retry_after() -> None:
    """Nothing live was left to move it to (or it moved too often): like the 503 before
    dispatch, the answer says when to try again."""
    choice = FakeChoice(0, [0.0], gives_up=True)
    call = SimpleNamespace(request_id="r1", chunks=choice.chunks, take=lambda chunk: None,
                           gateway=SimpleNamespace(settings=GatewaySettings(retry_after_s=3)))
    with pytest.raises(APIError) as refused:
        asyncio.run(collect(call))  # type: ignore[arg-type]
    assert refused.value.status == 503 and "no instance left" in refused.value.message
    assert refused.value.headers == {"Retry-After": "3"} and choice.closed


def test_completion_prompt_forms() -> None:
    assert CompletionRequest(model="m", prompt="hello").prompts == ["hello"]
    assert CompletionRequest(model="m", prompt=["hello"]).prompts == ["hello"]
    assert CompletionRequest(model="m", prompt=[1, 2]).prompts == [[1, 2]]
    assert CompletionRequest(model="m", prompt=["a", "b"]).prompts == ["a", "b"]
    assert CompletionRequest(model="m", prompt=[[1, 2], [3]]).prompts == [[1, 2], [3]]
    for prompt in ("", [""], [], ["a", ""], [[1], []], ["a"] * 129):
        with pytest.raises(ValidationError):
            CompletionRequest(model="m", prompt=prompt)
    with pytest.raises(ValidationError, match="at most 128 choices"):
        CompletionRequest(model="m", prompt=["a"] * 65, n=2)


async def echo(scope: Scope, receive: Receive, send: Send) -> None:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


def call(door: Door, path: str, body: bytes = b"", key: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=door)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post(path, content=body, headers=headers)

    return asyncio.run(go())


def test_door_wants_a_key_on_the_api_only() -> None:
    door = Door(echo, frozenset({"k1", "k2"}), protect_metrics=False, max_body_bytes=100)
    refused = call(door, "/v1/completions", b"x")
    assert refused.status_code == 401 and "API key" in refused.json()["error"]["message"]
    assert call(door, "/v1/completions", b"x", key="wrong").status_code == 401
    assert call(door, "/v1/completions", b"x", key="k2").text == "x"
    assert call(door, "/health").status_code == 200
    assert call(door, "/metrics").status_code == 200
    guarded = Door(echo, frozenset({"k1"}), protect_metrics=True, max_body_bytes=100)
    assert call(guarded, "/metrics").status_code == 401


def test_web_pages_of_the_origins_given_may_call_the_api() -> None:
    """DS_CORS_ORIGINS: a browser's preflight is answered before the key check (it carries
    no key), and the answer names the origin; other origins, and a gateway without the
    setting, get no CORS header."""
    async def ask(app: Any, origin: str) -> tuple[httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            preflight = await client.options("/v1/chat/completions", headers={
                "origin": origin, "access-control-request-method": "POST",
                "access-control-request-headers": "authorization, content-type"})
            models = await client.get("/v1/models", headers={"origin": origin})
            return preflight, models

    app = create_app(GatewaySettings(cors_origins="https://chat.example, https://b.example",
                                     api_keys="k1"))
    preflight, models = asyncio.run(ask(app, "https://chat.example"))
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://chat.example"
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    assert models.status_code == 401  # the key is still wanted, and the page may read why
    assert models.headers["access-control-allow-origin"] == "https://chat.example"
    preflight, _ = asyncio.run(ask(app, "https://evil.example"))
    assert "access-control-allow-origin" not in preflight.headers
    preflight, models = asyncio.run(ask(create_app(GatewaySettings()), "https://chat.example"))
    assert preflight.status_code == 405 and preflight.json()["error"]["message"]
    assert "access-control-allow-origin" not in models.headers


def test_head_a_trailing_slash_and_a_validators_message_answer_as_clients_expect() -> None:
    """HEAD where GET is served (a load balancer's health check) is a 200 without a body;
    a trailing slash is a JSON 404 naming the routes (not a 307 with an empty body); a
    validator's message comes without pydantic's "Value error, " before it."""
    async def ask(app: Any) -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [await client.head("/v1/models"), await client.head("/metrics"),
                    await client.post("/v1/chat/completions/", json={}),
                    await client.get("/v1/models/"),
                    await client.post("/v1/completions", json={"model": "m", "prompt": "hi",
                                                               "best_of": 3})]

    head, head_metrics, slash, models_slash, invalid = asyncio.run(
        ask(create_app(GatewaySettings())))
    assert models_slash.status_code == 404  # not a model named ""
    assert "does not serve /v1/models/;" in models_slash.json()["error"]["message"]
    assert (head.status_code, head.content) == (200, b"")
    assert head.headers["content-type"] == "application/json"
    assert head_metrics.status_code == 200
    assert slash.status_code == 404
    message = slash.json()["error"]["message"]
    assert "does not serve /v1/chat/completions/" in message
    assert "POST /v1/chat/completions," in message and "HEAD" not in message
    assert invalid.status_code == 400
    assert invalid.json()["error"]["message"].startswith("best_of is not served")


def test_an_instances_totals_are_counters_its_pool_gauges_and_both_leave_with_it() -> None:
    """The KV transfer and engine-loop totals only grow (a new incarnation starts again at 0):
    counters, `<name>_total`, so Prometheus's rate() takes a restart as a reset; the KV pool's
    free and total blocks go up and down: gauges. An instance no longer live leaves both."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    metrics = Metrics()
    decode = InstanceInfo(instance_id="decode-0", role="decode", steps=5, kv_bytes=4096,
                          kv_requests=2, step_seconds=0.25, free_blocks=3, total_blocks=4)
    prefill = InstanceInfo(instance_id="prefill-0", role="prefill", steps=1)
    metrics.instances(iter([decode, prefill]))  # the gateway hands it a generator
    families = {f.name: f for f in text_string_to_metric_families(
        generate_latest(metrics.registry).decode())}
    for name, _ in INSTANCE_TOTALS.values():
        assert families[name].type == "counter", name
        assert {s.name for s in families[name].samples} == {f"{name}_total"}
        assert {s.labels["instance"] for s in families[name].samples} == {"decode-0",
                                                                          "prefill-0"}
    assert families["ds_kv_free_blocks"].type == "gauge"

    def value(name: str, instance: str) -> float:
        return next(s.value for s in families[name].samples if s.labels["instance"] == instance)

    assert (value("ds_engine_steps", "decode-0"), value("ds_engine_steps", "prefill-0"),
            value("ds_kv_transfer_bytes", "decode-0"), value("ds_engine_step_seconds",
                                                              "decode-0"),
            value("ds_kv_free_blocks", "decode-0")) == (5, 1, 4096, 0.25, 3)
    metrics.instances([prefill])
    text = generate_latest(metrics.registry).decode()
    assert 'instance="prefill-0"' in text and 'instance="decode-0"' not in text


def test_a_probe_of_a_path_or_method_not_served_is_not_a_rejected_request() -> None:
    """`ds_requests{outcome="rejected"}` counts requests the API refused (a 400 here), not a
    scanner's or a health checker's probes of other paths and methods (404, 405), which
    still get the JSON error."""
    app = create_app(GatewaySettings())

    async def ask() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [await client.get("/favicon.ico"), await client.get("/v1/completions"),
                    await client.post("/v1/completions", json={"prompt": "hi", "n": 0})]

    missing, wrong_method, invalid = asyncio.run(ask())
    assert [r.status_code for r in (missing, wrong_method, invalid)] == [404, 405, 400]
    assert all(r.json()["error"]["message"] for r in (missing, wrong_method, invalid))
    registry = app.state.gateway.metrics.registry
    assert registry.get_sample_value("ds_requests_total", {"outcome": "rejected"}) == 1


def test_a_request_that_failed_on_the_instances_is_counted_once() -> None:
    """The gateway counts a request's outcome as it ends on the instances (refused: rejected;
    failed, or given up: error); answering it with the error does not count it again."""
    app = create_app(GatewaySettings())
    errors = iter([failed(TokenChunk(request_id="r", error="no", refused=True)),
                   failed(TokenChunk(request_id="r", error="broke")),
                   APIError(400, "a refusal the route makes")])

    @app.post("/fails")
    async def fails() -> None:
        raise next(errors)

    async def ask() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [(await client.post("/fails")).status_code for _ in range(3)]

    assert asyncio.run(ask()) == [400, 500, 400]
    registry = app.state.gateway.metrics.registry
    assert registry.get_sample_value("ds_requests_total", {"outcome": "rejected"}) == 1
    assert registry.get_sample_value("ds_requests_total", {"outcome": "error"}) is None


def test_the_responses_kept_unreadable_are_a_503_to_retry_and_none_kept_a_404() -> None:
    """Where Redis cannot be reached, a previous_response_id or a response asked for is a
    503 with Retry-After (a blip: a later try may do), not a 500; a gateway that keeps no
    responses (DS_RESPONSES_TTL_S=0) has none to show."""
    app = create_app(GatewaySettings())
    gateway = app.state.gateway
    transport = httpx.ASGITransport(app=app)

    async def ask() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            none = await client.get("/v1/responses/resp_1")
            gateway.responses = ResponseStore(redis_client(
                f"redis://127.0.0.1:{free_port()}", timeout_s=1), ttl_s=60)
            return [none, await client.post("/v1/responses", json={
                        "model": gateway.served_model, "input": "hi",
                        "previous_response_id": "resp_1"}),
                    await client.get("/v1/responses/resp_1"),
                    await client.delete("/v1/responses/resp_1")]

    none, *unreadable = asyncio.run(ask())
    assert none.status_code == 404 and "not kept" in none.json()["error"]["message"]
    for answer in unreadable:
        assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
        assert "cannot be read now" in answer.json()["error"]["message"]


def test_a_response_kept_is_its_api_keys_alone(redis_url: str) -> None:
    """A response belongs to the key that asked for it: with another key it is as missing as
    one never kept (read, listed, gone on from, deleted), so one tenant cannot read
    another's conversation by its id; its own key reads and deletes it."""
    app = create_app(GatewaySettings(api_keys="sk-ada,sk-bob"))
    gateway = app.state.gateway
    gateway.responses = ResponseStore(redis_client(redis_url), ttl_s=60)
    said = {"id": "resp_1", "object": "response", "output": [
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "Hello, Ada.", "annotations": []}]}]}
    transport = httpx.ASGITransport(app=app)

    def key(name: str) -> dict[str, str]:
        return {"Authorization": f"Bearer sk-{name}"}

    async def ask() -> dict[str, list[int]]:
        await gateway.responses.put(said, [{"type": "message", "role": "user",
                                            "content": "I am Ada."}], owner=owner_of("sk-ada"))
        codes: dict[str, list[int]] = {}
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            for name in ("bob", "ada"):
                answers = [await client.get("/v1/responses/resp_1", headers=key(name)),
                           await client.get("/v1/responses/resp_1/input_items",
                                            headers=key(name)),
                           await client.post("/v1/responses", headers=key(name), json={
                               "model": gateway.served_model, "input": "Who am I?",
                               "previous_response_id": "resp_1", "max_output_tokens": 1}),
                           await client.delete("/v1/responses/resp_1", headers=key(name))]
                codes[name] = [a.status_code for a in answers]
                if name == "bob":
                    assert "resp_1" in answers[0].json()["error"]["message"]
                    assert answers[2].json()["error"]["code"] == "previous_response_not_found"
                else:
                    assert answers[0].json() == said
            codes["gone"] = [(await client.get("/v1/responses/resp_1",
                                               headers=key("ada"))).status_code]
        return codes

    codes = asyncio.run(ask())
    # Ada's own: read, listed, gone on from (no worker here: 503), deleted, then gone
    assert codes == {"bob": [404, 404, 400, 404], "ada": [200, 200, 503, 200], "gone": [404]}
    assert owner_of("") == "" and owner_of("sk-ada") not in ("", owner_of("sk-bob"))


@pytest.mark.parametrize(("path", "body", "param", "says"), [
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, "best_of", "best_of is not served"),
    ("/v1/completions", {"prompt": "hi", "suffix": "}"}, "suffix", "suffix"),
    ("/v1/completions", {"prompt": "hi", "tool_choice": "required"}, "tool_choice",
     "goes with tools"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", "goes with echo"),
    ("/v1/completions", {"prompt": ["a", "b"], "n": 100}, "n", "at most 128 choices"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities", "audio output"),
    ("/v1/chat/completions", {"stream_options": {}}, "stream_options", "with stream: true"),
    ("/v1/chat/completions", {"guided_choice": ["x"], "structured_outputs": {"regex": "a"}},
     "guided_choice", "each hold the answer to a format"),
    ("/v1/chat/completions", {"temperature": float("nan")}, "temperature", "finite number"),
    ("/v1/completions", {"prompt": "hi", "top_p": float("inf")}, "top_p", "finite number"),
    # JSON's types as they are, as OpenAI reads them: no number from a string, no count from
    # a boolean or a fraction, no boolean from a word
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, "max_tokens", "valid integer"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": True}, "max_tokens", "valid integer"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 5.5}, "max_tokens", "valid integer"),
    ("/v1/chat/completions", {"stream": "yes"}, "stream", "valid boolean"),
    ("/v1/chat/completions", {"temperature": "0.5"}, "temperature", "valid number"),
    ("/v1/chat/completions", {"stream": True, "stream_options": {"include_usage": 1}},
     "stream_options.include_usage", "valid boolean"),
    # (this app's gateway has not started: it keeps no responses)
    ("/v1/responses", {"previous_response_id": "resp_1"}, "previous_response_id",
     "responses are not kept on this server"),
    ("/v1/responses", {"max_output_tokens": 0}, "max_output_tokens", "greater than or equal"),
    ("/v1/responses", {"tools": [{"type": "web_search"}]}, "tools", "are not served"),
    ("/v1/responses", {"tool_choice": "required"}, "tool_choice", "needs tools"),
    ("/v1/responses", {"tools": [{"type": "function", "name": "f"}],
                       "text": {"format": {"type": "json_object"}}}, "text.format",
     "tools and text.format"),
])
def test_a_refusal_names_the_parameter_to_blame(path: str, body: dict[str, Any], param: str,
                                                says: str) -> None:
    """A request-wide validator's refusal names its parameter as a field's does (it was
    null); NaN and infinity (Python's JSON reads them) are refused as numbers, not as
    "less than or equal to 2"; a value of another JSON type than the parameter's is refused,
    not converted."""
    base: dict[str, Any] = {"model": GatewaySettings().served_model}
    if "chat" in path:
        base["messages"] = [{"role": "user", "content": "hi"}]
    if "responses" in path:
        base["input"] = "hi"

    async def ask() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(GatewaySettings()))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post(path, content=json.dumps(base | body),
                                     headers={"content-type": "application/json"})

    refused = asyncio.run(ask())
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == param and says in error["message"], error
    # a field's message is the type's ("Input should be ...") and gets the field's name after
    # it; a request-wide validator's names it already
    assert error["message"].endswith(f" ({param})") == error["message"].startswith("Input")


def test_numbers_are_read_as_json_schema_reads_them() -> None:
    """Strict types still read JSON's numbers as JSON Schema does (the OpenAPI schema served
    says "integer" and "number"; a client generated from it may send either): `"temperature":
    1` is the number 1.0, `"max_tokens": 2.0` and token ids 1.0 are integers, a logit bias of
    5 a bias of 5.0."""
    request = CompletionRequest.model_validate({
        "model": "m", "prompt": [1.0, 2], "temperature": 1, "max_tokens": 2.0, "n": 1.0,
        "logit_bias": {"7": 5}})
    assert (request.temperature, request.prompt, request.max_tokens, request.n,
            request.logit_bias) == (1.0, [1, 2], 2, 1, {"7": 5.0})
    assert all(type(v) is int for v in (*request.prompt, request.max_tokens, request.n))


def test_a_body_that_is_not_json_is_told_where_once() -> None:
    body = '{"model": "m", "prompt": "hi",'

    async def ask() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(GatewaySettings()))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post("/v1/completions", content=body,
                                     headers={"content-type": "application/json"})

    refused = asyncio.run(ask())
    assert refused.status_code == 400
    assert refused.json()["error"] == {
        "message": f"the request body is not valid JSON (at character {len(body)})",
        "type": "invalid_request_error", "param": None, "code": None}


def test_door_bounds_the_body() -> None:
    door = Door(echo, frozenset(), protect_metrics=False, max_body_bytes=100)
    assert call(door, "/v1/completions", b"x" * 100).text == "x" * 100
    too_big = call(door, "/v1/completions", b"x" * 101)
    assert too_big.status_code == 413 and "larger than 100 bytes" in \
        too_big.json()["error"]["message"]


def test_view_offers_recently_heard_instances_when_none_is_strictly_live() -> None:
    view = InstanceView(ttl_s=2.0)
    view.observe(info("p0"), 0.0)
    for t in (0.0, 1.0, 2.0, 3.0):  # p0 starved: silent next to d0
        view.observe(info("d0", "decode"), t)
    assert view.instances("prefill", 3.0) == []
    assert [i.instance_id for i in view.recent("prefill", 3.0)] == ["p0"]
    assert view.recent("prefill", 11.0) == []  # beyond the hard TTL: gone


def worker(instance_id: str, role: str, **fields: object) -> InstanceInfo:
    return InstanceInfo(instance_id=instance_id, role=role, max_running=8,  # type: ignore[arg-type]
                        **fields)


@functools.cache
def built_gateway() -> Gateway:
    return Gateway(GatewaySettings())  # reads the model's tokenizer: once


def route(gateway: Gateway, hold: bool = False, prompt: Sequence[int] = ()
          ) -> tuple[str, str]:
    """Where the next request (of `prompt`) goes: (worker, decode); its booking is settled
    at once unless `hold` (a request still in flight)."""
    ticket = gateway.ledger.admit(limit=1000)
    target = gateway.dispatch(ticket, gateway.affinity.hashes(prompt), len(prompt))
    if not hold:
        ticket.release()
    return target.worker, target.decode


def gateway_seeing(mode: str, *instances: InstanceInfo) -> Gateway:
    """The gateway, not started, in `mode` with these instances live and nothing in flight."""
    gateway = built_gateway()
    gateway.settings = GatewaySettings(mode=mode)  # type: ignore[arg-type]
    gateway.view, gateway.ledger = InstanceView(gateway.settings.heartbeat_ttl_s), Ledger()
    gateway.affinity, gateway.decode_affinity = PrefixAffinity(), PrefixAffinity()
    gateway.stuck = {}
    for instance in instances:
        gateway.view.observe(instance, time.monotonic())
    return gateway


def test_a_request_moved_to_a_colocated_worker_awaits_its_first_token_there() -> None:
    """After a move the worker prefills the prompt and every token so far again: until its
    first chunk the request counts as queued there, as a new one would."""
    gateway = gateway_seeing("colocated", worker("c0", "colocated"))
    relay = Relay(None, gateway.view, "r1", "c0", "", stall_s=1.0)  # type: ignore[arg-type]
    booking = gateway._book(relay)
    assert gateway.ledger.queued == {"c0": 1} and gateway.ledger.decoding == {"c0": 1}
    booking.prefilled()  # its first chunk came
    booking.settle()
    assert gateway.ledger.queued == {"c0": 0} and gateway.ledger.decoding == {"c0": 0}


def test_an_auto_gateway_dispatches_to_whichever_mode_is_live() -> None:
    """While the planner switches modes both kinds of workers are live: each request goes to
    the route whose decoding instance is least loaded; draining workers get none."""
    pair = (worker("p0", "prefill"), worker("d0", "decode"))
    gateway = gateway_seeing("auto", *pair)
    assert route(gateway) == ("p0", "d0")
    gateway.view.observe(worker("c0", "colocated", chunked=True), time.monotonic())
    gateway.ledger.book("p0", "d0")  # d0 holds one request, c0 none
    assert route(gateway) == ("c0", "")
    gateway.ledger.book("c0", "")
    gateway.ledger.book("c0", "")
    assert route(gateway) == ("p0", "d0")
    # the old mode drained away: only the colocated worker is dispatched to
    for old in pair:
        gateway.view.observe(old.model_copy(update={"draining": True}), time.monotonic())
    assert route(gateway) == ("c0", "")
    health = gateway.routes(gateway.live_pools())
    assert [t.worker for t in health] == ["c0"]


def test_a_burst_spreads_before_any_stream_opens() -> None:
    """Requests dispatched back to back, none of them started yet, go to different
    instances: each is counted at dispatch (a burst once landed on one prefill instance)."""
    gateway = gateway_seeing("disaggregated", worker("p0", "prefill"), worker("p1", "prefill"),
                             worker("d0", "decode"), worker("d1", "decode"))
    burst = [route(gateway, hold=True) for _ in range(4)]
    assert sorted(p for p, _ in burst) == ["p0", "p0", "p1", "p1"]
    assert sorted(d for _, d in burst) == ["d0", "d0", "d1", "d1"]
    assert gateway.ledger.per_instance() == {"p0": 2, "p1": 2, "d0": 2, "d1": 2}


def next_turn(gateway: Gateway, decode: str, prompt: list[int], holder: str, ahead: int,
              requests: int = 1) -> str:
    """Where the next turn of `prompt` goes while its `holder` holds `requests` with `ahead`
    prompt tokens to compute (the turn before's whole blocks cached there, and no more
    elsewhere); what it is booked to compute there is checked."""
    saved = (len(prompt) - 1) // 16 * 16
    prompt.extend([7] * 20)
    gateway.ledger = Ledger()
    for _ in range(requests):
        gateway.ledger.book(holder, decode, ahead // requests)
    hashes = gateway.affinity.hashes(prompt)
    assert gateway.affinity.found(hashes) == (holder, {holder: saved // 16})
    went = gateway.dispatch(gateway.ledger.admit(limit=1000), hashes, len(prompt)).worker
    booked = gateway.ledger.pending[went] - ahead * (went == holder)
    assert booked == len(prompt) - saved * (went == holder)  # computed there
    return went


def test_a_prompt_goes_to_the_instance_its_start_went_to_while_that_saves_time() -> None:
    """Two conversations, each turn sent again with the next: while the instances are
    equally loaded each turn goes where its conversation's start went (its KV cached
    there), not to the first by name; and while the other instance has as many prompt
    tokens to compute first as that cache saves, a colocated worker holding one request
    more at most. Past either, it goes to the least loaded. So a burst of one prompt spreads
    over colocated workers and stays on the prefill instance that holds all but its last
    block (each computes 4 tokens there, 100 elsewhere)."""
    for mode, names in (("disaggregated", ("p0", "p1")), ("colocated", ("c0", "c1"))):
        role = "prefill" if mode == "disaggregated" else "colocated"
        decode = "d0" if mode == "disaggregated" else ""
        gateway = gateway_seeing(mode, *(worker(n, role) for n in names),
                                 worker("d0", "decode"))
        one, other = list(range(100, 140)), list(range(500, 540))
        first = route(gateway, hold=True, prompt=one)[0]  # in flight: the next goes elsewhere
        second = route(gateway, prompt=other)[0]
        assert {first, second} == set(names)
        assert gateway.ledger.pending == {first: 40, second: 0}  # its prompt's, till answered
        gateway.ledger = Ledger()  # both answered
        for turn in range(3):
            one += [7] * 20
            other += [8] * 20
            assert route(gateway, prompt=other)[0] == second, (mode, turn)
            assert route(gateway, prompt=one)[0] == first, (mode, turn)
        turn = functools.partial(next_turn, gateway, decode)
        assert turn(one, first, ahead=(len(one) - 1) // 16 * 16) == first  # as it saves
        if mode == "colocated":  # one request more than the other: within the slack
            assert turn(one, first, ahead=0, requests=1) == first
            assert turn(other, second, ahead=0, requests=2) == first  # two: past it
        assert turn(one, first, ahead=(len(one) - 1) // 16 * 16 + 1) == second  # more
        gateway.ledger = Ledger()
        burst = [route(gateway, hold=True, prompt=other)[0] for _ in range(4)]
        if mode == "colocated":
            assert sorted(burst) == sorted([*names, *names])
        else:
            assert burst == [second] * 4


@pytest.mark.parametrize("role, state", [("colocated", {"max_running": 1}),
                                         ("colocated", {"draining": True}),
                                         ("prefill", {"queue_len": 3})])
def test_a_prompt_is_not_leant_to_a_holder_full_draining_or_busier_than_counted(
        role: str, state: dict[str, object]) -> None:
    """The instance a prompt's start went to, holding one request with nothing left to
    compute, takes the next turn; not where it has no room for it (a colocated worker at
    its batch), drains, or its heartbeat's queue holds more than the gateways count (a
    prefill instance): then the least loaded does."""
    mode = "disaggregated" if role == "prefill" else "colocated"
    decode = "d0" if role == "prefill" else ""
    gateway = gateway_seeing(mode, worker("a", role), worker("b", role), worker("d0", "decode"))
    prompt = list(range(100, 200))
    assert route(gateway, prompt=prompt)[0] == "a"
    assert next_turn(gateway, decode, prompt, "a", ahead=0) == "a"
    gateway.view.observe(InstanceInfo(instance_id="a", role=role,  # type: ignore[arg-type]
                                      **({"max_running": 8} | state)), time.monotonic())
    assert next_turn(gateway, decode, prompt, "a", ahead=0) == "b"


def test_a_prompt_weighs_what_each_instance_may_hold() -> None:
    """Both workers were sent a system prompt: a new conversation's prompt, which shares
    only that, is not drawn to the one the system prompt went to last, where it would save
    no more than on the other; it goes to the least loaded."""
    gateway = gateway_seeing("colocated", worker("c0", "colocated"), worker("c1", "colocated"))
    system = list(range(100, 164))  # four blocks
    assert route(gateway, hold=True, prompt=[*system, *range(1000, 1036)])[0] == "c0"
    assert route(gateway, prompt=[*system, *range(2000, 2036)])[0] == "c1"
    gateway.ledger = Ledger()
    gateway.ledger.book("c1", "", 30)  # c1 has a little to compute, and holds one more
    prompt = [*system, *range(3000, 3036)]
    assert gateway.affinity.found(gateway.affinity.hashes(prompt)) == ("c1", {"c1": 4, "c0": 4})
    assert route(gateway, prompt=prompt)[0] == "c0"


def test_a_prompt_goes_on_to_the_decode_instance_its_start_was_decoded_on() -> None:
    """A decode instance keeps a conversation's blocks cached too and pulls only the blocks
    after them: each turn goes on to the decode instance its conversation's start went to
    while the load allows, though another has more free blocks (which alone would pick
    it), and while it has room for the request; a burst still spreads."""
    gateway = gateway_seeing("disaggregated", worker("p0", "prefill"),
                             worker("d0", "decode", free_blocks=100),
                             worker("d1", "decode", free_blocks=300))
    one, other = list(range(100, 140)), list(range(500, 540))
    first = route(gateway, hold=True, prompt=one)[1]
    second = route(gateway, prompt=other)[1]
    assert (first, second) == ("d1", "d0")  # the most free blocks, then the load
    gateway.ledger = Ledger()
    for turn in range(3):
        one += [7] * 20
        other += [8] * 20
        assert route(gateway, prompt=other)[1] == "d0", turn
        assert route(gateway, prompt=one)[1] == "d1", turn
    gateway.view.observe(worker("d1", "decode", free_blocks=6), time.monotonic())
    assert route(gateway, prompt=one)[1] == "d0"  # 6 free blocks of the 8 it needs
    burst = [route(gateway, hold=True, prompt=other)[1] for _ in range(2)]
    assert sorted(burst) == ["d0", "d1"]


def test_a_fixed_mode_gateway_dispatches_to_its_mode_only() -> None:
    disaggregated = gateway_seeing("disaggregated", worker("c0", "colocated"),
                                   worker("p0", "prefill"))
    with pytest.raises(APIError) as refused:
        route(disaggregated)  # no decode instance; the colocated worker is not its mode
    assert refused.value.status == 503 and "prefill/decode instance" in refused.value.message
    assert refused.value.headers["Retry-After"] == "1"
    colocated = gateway_seeing("colocated", worker("c0", "colocated"), worker("p0", "prefill"),
                               worker("d0", "decode"))
    assert route(colocated) == ("c0", "")
    with pytest.raises(APIError, match="colocated worker nor prefill and decode"):
        route(gateway_seeing("auto", worker("p0", "prefill")))


def test_a_failed_instance_is_in_no_route_where_another_serves() -> None:
    gateway = gateway_seeing("auto", worker("c0", "colocated"), worker("p0", "prefill"),
                             worker("d0", "decode"), worker("d1", "decode"))
    pools = gateway.live_pools()
    # c0 failed: it is the least loaded, yet the move goes to a prefill/decode pair
    assert [(t.worker, t.decode) for t in gateway.routes(pools, avoid="c0")] == [("p0", "d0")]
    assert {t.decode for t in gateway.routes(pools, avoid="d0")} == {"", "d1"}
    # the only decode instance failed: the colocated worker serves, and no route has d0
    only = {"colocated": pools["colocated"], "prefill": pools["prefill"],
            "decode": [i for i in pools["decode"] if i.instance_id == "d0"]}
    assert [(t.worker, t.decode) for t in gateway.routes(only, avoid="d0")] == [("c0", "")]


def test_a_dead_worker_is_dispatched_to_only_when_nothing_is_live() -> None:
    """A colocated worker silent next to its peers (dead, its count zero) draws no request
    while a live prefill/decode pair serves; heard-from-lately instances are the fallback
    when no route is live."""
    gateway = gateway_seeing("auto", worker("p0", "prefill"), worker("d0", "decode"))
    now = time.monotonic()
    gateway.view.observe(worker("c0", "colocated"), now - 5.0)  # silent next to p0 and d0
    gateway.ledger.book("p0", "d0")
    assert route(gateway) == ("p0", "d0")
    quiet = gateway_seeing("auto")
    quiet.view.observe(worker("c0", "colocated"), now - 5.0)
    quiet.view.observe(worker("p0", "prefill"), now)  # p0 alone serves nothing
    assert route(quiet)[0] == "c0"


def test_an_instance_whose_engine_is_stuck_gets_requests_only_when_none_else_serves(
        caplog: pytest.LogCaptureFixture) -> None:
    """An engine thread wedged with the GIL released heartbeats on: at one step or call
    past DS_STUCK_AFTER_S (10 s), by its own clock, the instance is left out of dispatch,
    and back once it moves on; where no route is served otherwise, routes through stuck
    instances are the fallback (as dead ones are: better a request that may have to move
    than a 503), each role's serving instances first."""
    beat = time.time() + 1000.0  # the worker's clock, not the gateway's
    wedged = worker("d0", "decode", stuck_since=beat - 11, heartbeat_at=beat)
    slow = worker("d1", "decode", stuck_since=beat - 9, heartbeat_at=beat)  # a long step
    assert (stuck_for(wedged), stuck_for(worker("d2", "decode", heartbeat_at=beat))) == \
        (pytest.approx(11), 0.0)
    gateway = gateway_seeing("disaggregated", worker("p0", "prefill"), wedged, slow)
    gateway.ledger.book("p0", "d1")  # d0 is the least loaded
    with caplog.at_level(logging.INFO, logger="services.gateway.gateway"):
        assert [route(gateway) for _ in range(2)] == [("p0", "d1")] * 2
        assert gateway.stuck == {"prefill": set(), "decode": {"d0"}}
        gateway.view.observe(wedged.model_copy(update={"stuck_since": 0.0}), time.monotonic())
        assert route(gateway) == ("p0", "d0")  # its step ended
    said = [r.getMessage() for r in caplog.records]
    assert said == ["d0: its engine has been at one step or call for 11 s "
                    "(DS_STUCK_AFTER_S=10); sending it nothing until it moves on",
                    "d0: its engine moves on again; dispatching to it"]
    # the fallback is per role: p0 stuck beside p1, every decode instance stuck
    stuck_p0 = worker("p0", "prefill", stuck_since=beat - 11, heartbeat_at=beat)
    alone = gateway_seeing("disaggregated", stuck_p0, worker("p1", "prefill"), wedged)
    alone.ledger.book("p1", "d0")  # p0 is the least loaded
    assert route(alone) == ("p1", "d0")
    assert alone.routes(alone.stuck_pools())  # /health: a request can be served
    resumed = asyncio.run(alone._decode_to_resume("d9", deadline=time.monotonic()))
    assert resumed is not None and resumed.instance_id == "d0"
    # a moved request resumes from the KV a stuck prefill instance holds only where no other
    # serves and no pull from it just failed
    assert alone.resumable_from("p1", "decode_died")
    assert not alone.resumable_from("p0", "decode_died")  # p1 serves: prefilled again there
    lone = gateway_seeing("disaggregated", stuck_p0, wedged)
    assert lone.resumable_from("p0", "decode_died")
    assert not lone.resumable_from("p0", "kv_transfer")
    # auto mode: a colocated worker serves, so the stuck prefill instance gets nothing,
    # however loaded the worker, and a move resumes on no stuck decode instance
    auto = gateway_seeing("auto", stuck_p0, worker("d1", "decode"), worker("c0", "colocated"))
    for _ in range(3):
        auto.ledger.book("c0", "")
    assert [route(auto) for _ in range(2)] == [("c0", "")] * 2
    auto = gateway_seeing("auto", worker("p0", "prefill"), wedged, worker("c0", "colocated"))
    assert asyncio.run(auto._decode_to_resume("d9", deadline=time.monotonic())) is None
    # a move resumes on a decode instance whose engine goes on, however loaded
    both = gateway_seeing("disaggregated", worker("p0", "prefill"), wedged, slow)
    both.ledger.book("p0", "d1")
    resumed = asyncio.run(both._decode_to_resume("d9", deadline=time.monotonic()))
    assert resumed is not None and resumed.instance_id == "d1"


def test_kv_held_resumes_on_a_decode_instance_while_its_prefill_instance_drains() -> None:
    """Fixed disaggregated mode, the only prefill instance draining, d0 failed: the request
    resumes on d1 from the KV p0 holds (no second prefill instance needed)."""
    gateway = gateway_seeing("disaggregated", worker("p0", "prefill", draining=True),
                             worker("d0", "decode"), worker("d1", "decode"))
    assert gateway.routes(gateway.live_pools()) == []
    decode = asyncio.run(gateway._decode_to_resume("d0", deadline=time.monotonic()))
    assert decode is not None and decode.instance_id == "d1"


def test_the_served_model_name_is_the_directorys_unless_given(tmp_path: Path) -> None:
    directory = tmp_path / "Qwen3-0.6B"
    directory.mkdir()
    assert GatewaySettings(model=str(directory)).served_model == "Qwen3-0.6B"
    assert GatewaySettings(model=f"{directory}/").served_model == "Qwen3-0.6B"
    assert GatewaySettings(model=str(directory), served_model_name="qwen").served_model == "qwen"
    assert GatewaySettings(model="smollm2-135m").served_model == "smollm2-135m"


def test_a_gateway_id_cannot_break_the_in_flight_keys() -> None:
    """The id is the last field of each of its Redis keys (subjects.inflight_key)."""
    assert GatewaySettings(gateway_id="gateway-a").gateway_id == "gateway-a"
    for bad in ("host:8000", "gw*", "gw[1]"):
        with pytest.raises(ValidationError):
            GatewaySettings(gateway_id=bad)


def test_text_offsets_index_the_text_where_it_leaves_special_tokens_out() -> None:
    """A completion's logprobs give each token's place in the text (text_offset). The
    generated text leaves special tokens out (an end of turn generated under ignore_eos),
    the echoed prompt's holds them as written: each token is found at its offset, and a
    left-out one sits where the next begins (before, the offsets ran ten characters ahead
    after each <|im_end|>)."""
    tokenizer = read_tokenizer("smollm2-135m")
    end = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert len(end) == 1 and not tokenizer.in_text(end[0])
    prompt = "<|im_start|>user Hi"
    prompt_ids = tokenizer.encode(prompt)
    assert any(not tokenizer.in_text(t) for t in prompt_ids)  # a special token in the prompt
    generated = tokenizer.encode(" Paris") + end + tokenizer.encode(" is")
    text = tokenizer.decode(generated)
    assert text == " Paris is"
    call = Call(SimpleNamespace(tokenizer=tokenizer), False, None, None,  # type: ignore[arg-type]
                prompt_ids, Sampling(max_tokens=8, logprobs=True), "r1", echo=prompt)
    call.scores = {p: (-1.0, []) for p in range(len(prompt_ids))}
    shown, block = call.show(TokenChunk(request_id="r1", token_ids=generated, text=text,
                                        logprobs=[-0.5] * len(generated)))
    assert shown == prompt + text and block is not None
    tokens, offsets = block["tokens"], block["text_offset"]
    assert len(tokens) == len(prompt_ids) + len(generated)
    for i, (token, offset) in enumerate(zip(tokens, offsets, strict=True)):
        if i >= len(prompt_ids) and token == "<|im_end|>":
            assert offset == offsets[i + 1]  # left out of the text
        else:
            assert shown[offset:offset + len(token)] == token, (i, token, offset)


def test_a_prompt_that_can_never_fit_names_the_field_it_came_in() -> None:
    """A completion's prompt is `prompt`, a chat's `messages`; a fitting prompt whose
    max_tokens does not fit names max_tokens."""
    gateway, target = built_gateway(), Target("p0", "d0", max_request_tokens=100)
    chat = ChatRequest.model_validate({"model": "m", "messages": [{"role": "user",
                                                                   "content": "hi"}]})
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "hi",
                                                   "max_tokens": 200})
    for req, length, param in ((chat, 100, "messages"), (completion, 100, "prompt"),
                               (completion, 99, "max_tokens")):
        with pytest.raises(APIError, match="maximum context length is 100") as e:
            gateway.sampling(target, length, req)
        assert e.value.body()["error"]["param"] == param
        assert e.value.body()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("kind", ["byte-level BPE", "SentencePiece",
                                  "SentencePiece, a prompt of special tokens only"])
def test_logprobs_follow_the_text_and_leave_out_a_stop_string(kind: str, chat: bool) -> None:
    """A worker holds back text that may begin a stop string and leaves the stop string out
    of the text; the logprobs go with the text: streamed, a token's come once the text shown
    reaches it, and the tokens of the stop string are not shown (before, ' 5, 6' came with
    the logprobs of ' 5, 6, 7'); each at its place in the text, also where a SentencePiece
    decoder strips the text's leading space (a prompt that gives the output no context).
    Chunks as the engine's TextState makes them."""
    if kind == "byte-level BPE":
        tokenizer, said, stop, text = read_tokenizer("smollm2-135m"), " 5, 6, 7, 8", ", 7", " 5, 6"
    else:
        tokenizer, said, stop, text = spm_like(), "Hello world, x, y", " x", " Hello world,"
    prompt = tokenizer.encode("Say:")
    if kind.endswith("special tokens only"):
        prompt, text = [1, 2], text.lstrip()  # <s></s>: the decoder strips the leading space
    ids = tokenizer.encode(said)
    state = TextState(tokenizer, (stop,), prompt=prompt)
    chunks = []
    for seq, token in enumerate(ids):
        delta, hit = state.advance(ids[:seq + 1])  # the output so far, as the engine gives it
        chunks.append(TokenChunk(request_id="r", seq=seq, token_ids=[token], text=delta,
                                 logprobs=[-0.5], finish_reason="stop" if hit else None))
        if hit:
            break
    assert "".join(c.text for c in chunks) == text and len(chunks) < len(ids)
    # where each token begins in the text, and those that begin within it
    context = tokenizer.context_of(prompt)
    before = len(tokenizer.decode(context))
    starts = [len(tokenizer.decode(context + ids[:i])) - before for i in range(len(chunks))]
    expected = [tokenizer.token_piece(t)[0] for t, at in zip(ids[:len(chunks)], starts, strict=True)
                if at < len(text)]

    def call() -> Call:
        return Call(SimpleNamespace(tokenizer=tokenizer), chat, None, None,  # type: ignore[arg-type]
                    prompt, Sampling(max_tokens=8, logprobs=True), "r")

    def tokens_of(block: dict[str, Any] | None) -> list[str]:
        if block is None:
            return []
        if not chat:  # each where the text has it
            assert block["text_offset"] == starts[len(seen):len(seen) + len(block["tokens"])]
        return [e["token"] for e in block["content"]] if chat else block["tokens"]

    streamed, shown, seen = call(), 0, []
    for c in chunks:
        delta, block = streamed.show(c)
        shown += len(delta)
        seen += tokens_of(block)
        assert all(at < shown for at in starts[:len(seen)])  # none ahead of the text
    assert seen == expected
    whole = TokenChunk(request_id="r", token_ids=[t for c in chunks for t in c.token_ids],
                       text=text, logprobs=[-0.5] * len(chunks), finish_reason="stop")
    seen = []
    _, block = call().show(whole)
    assert tokens_of(block) == expected


@pytest.mark.parametrize("prompt", ["Hello world", " Hello world"])
@pytest.mark.parametrize("bos", [True, False], ids=["bos", "no-bos"])
@pytest.mark.parametrize("as_ids", [False, True])
def test_an_echoed_prompt_s_offsets_leave_out_what_its_text_does_not_hold(
        as_ids: bool, bos: bool, prompt: str) -> None:
    """A prompt written as text and encoded with a BOS (Llama 2's, 3's tokenizers add one)
    echoes as written: the BOS takes no place in it, nor the leading space a SentencePiece
    decoder strips; a prompt of token ids echoes as they decode, its BOS spelled. Each token
    is found at its offset, and the generated text's tokens follow the echo (before, every
    offset ran four characters ahead of a string prompt's text; one that began with a space
    ran one ahead)."""
    tokenizer = spm_like(add_bos=bos)
    prompt_ids = tokenizer.encode(prompt, True)
    assert (tokenizer.token_piece(prompt_ids[0])[0] == "<s>") == bos
    echo = tokenizer.decode(prompt_ids, skip_special_tokens=False) if as_ids else prompt
    generated = tokenizer.encode(", x")
    state = TextState(tokenizer, (), prompt=prompt_ids)  # the text as the engine makes it
    text = state.advance(generated)[0] + state.flush()
    call = Call(SimpleNamespace(tokenizer=tokenizer), False, None, None,  # type: ignore[arg-type]
                prompt_ids, Sampling(max_tokens=8, logprobs=True), "r1", echo=echo)
    call.scores = {p: (-1.0, []) for p in range(len(prompt_ids))}
    shown, block = call.show(TokenChunk(request_id="r1", token_ids=generated, text=text,
                                        logprobs=[-0.5] * len(generated), finish_reason="length"))
    assert shown == echo + text and block is not None
    tokens, offsets = block["tokens"], block["text_offset"]
    assert len(tokens) == len(prompt_ids) + len(generated)
    assert offsets == sorted(offsets)
    for i, (token, offset) in enumerate(zip(tokens, offsets, strict=True)):
        found = shown[offset:offset + len(token)]
        if found != token:  # a BOS the text does not hold; a leading space stripped
            assert (token == "<s>" and not as_ids) or (token.startswith(" ") and
                                                        found.startswith(token[1:])), (i, token)
    assert offsets[len(prompt_ids)] == len(echo)  # the generated text after the echo
    assert offsets[-1] + len(tokens[-1]) == len(shown)


def test_a_stuck_decode_instance_s_batch_is_not_counted_as_capacity() -> None:
    """The 429 limit is twice what the serving decode instances batch: a stuck one runs
    nothing sent to it, so it counts for nothing while another serves; where every one is
    stuck they count (requests wait for them), and never under 16."""
    now = time.time()

    def decode(instance_id: str, stuck_for_s: float) -> InstanceInfo:
        return InstanceInfo(instance_id=instance_id, role="decode", max_running=32,
                            heartbeat_at=now, stuck_since=now - stuck_for_s if stuck_for_s
                            else 0.0)

    prefill = worker("p0", "prefill")
    assert gateway_seeing("disaggregated", prefill, decode("d0", 0), decode("d1", 0)
                          ).inflight_limit() == 128
    assert gateway_seeing("disaggregated", prefill, decode("d0", 30), decode("d1", 0)
                          ).inflight_limit() == 64
    assert gateway_seeing("disaggregated", prefill, decode("d0", 30), decode("d1", 30)
                          ).inflight_limit() == 128
    assert gateway_seeing("disaggregated", prefill, decode("d0", 5), decode("d1", 0)
                          ).inflight_limit() == 128  # stuck under DS_STUCK_AFTER_S: not yet
    colocated = worker("c0", "colocated", heartbeat_at=now)  # batches 8; dispatch goes there
    assert gateway_seeing("auto", prefill, decode("d0", 30), decode("d1", 30), colocated
                          ).inflight_limit() == 16


def _chain(depth: int) -> dict[str, Any]:
    """A schema whose grammar doubles with each level: a handful of lines, past any limit."""
    defs: dict[str, Any] = {"d0": {"type": "object", "properties": {"p0": {"type": "integer"}}}}
    for i in range(1, depth):
        below = {"$ref": f"#/$defs/d{i - 1}"}
        defs[f"d{i}"] = {"oneOf": [below, {"allOf": [
            below, {"properties": {f"p{i}": {"type": "integer"}}}]}]}
    return {"$defs": defs, "$ref": f"#/$defs/d{depth - 1}"}


def nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        value = {"type": "object", "properties": {"a": value}}
    return value


def schema(value: Any, **spec: Any) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"schema": value, **spec}}}


@pytest.mark.parametrize(("body", "param", "says"), [
    (schema({"type": "foo"}), "response_format", "Invalid type: foo"),
    (schema({"type": "string", "pattern": "["}), "response_format", "unclosed character class"),
    (schema({"type": "array", "minItems": 5, "maxItems": 2}), "response_format",
     "Unsatisfiable"),
    (schema({"$ref": "#"}), "response_format", "no text satisfies it"),
    (schema({"$ref": "#/nowhere"}), "response_format", "does not exist"),
    # strict: what the decoding does not implement is refused, not ignored, whatever the
    # schema's own options say
    (schema({"type": "object", "if": {}}, strict=True), "response_format", "Unimplemented"),
    (schema({"type": "object", "if": {}, "x-guidance": {"lenient": True}}, strict=True),
     "response_format", "Unimplemented"),
    # past the limits an engine holds a request's grammar to: refused before any engine
    # spends a second on it (llguidance's own limits take 0.7 s to fail this one)
    (schema(_chain(12)), "response_format", "too big"),
    (schema({"enum": [f"value {i}" for i in range(10_000)]}), "response_format", "too large"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs", "GBNF"),
    ({"guided_regex": "("}, "guided_regex", "unclosed group"),
    ({"guided_choice": []}, "guided_choice", "one or more non-empty strings"),
    ({"guided_json": "{not json"}, "guided_json", "key must be a string"),
    (schema(nested(2000)), "response_format", "recursion"),  # deeper than Python encodes
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": nested(2000)}}]}, "tool_choice", "recursion"),
])
def test_a_format_no_answer_can_be_held_to_is_a_400_naming_it(body: dict[str, Any],
                                                               param: str, says: str) -> None:
    gateway = Gateway(GatewaySettings())
    asked = ChatRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]} | body)
    with pytest.raises(APIError) as refused:  # (a model whose calls are Hermes')
        asyncio.run(gateway.grammar(asked, "hermes"))
    assert refused.value.status == 400 and refused.value.param == param
    assert says in refused.value.message and param in refused.value.message


def test_a_required_call_is_held_to_the_models_call_format() -> None:
    """tool_choice required or naming a function: the answer's grammar is a call's in the
    model's format (where the model has one; without, routes refuses the tools)."""
    gateway = Gateway(GatewaySettings())
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}},
             {"type": "function", "function": {"name": "g"}}]
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    named = ChatRequest.model_validate(base | {"tool_choice": {
        "type": "function", "function": {"name": "f"}}, "parallel_tool_calls": False})
    assert named.forced_functions == [tools[0]["function"]]
    hermes = asyncio.run(gateway.grammar(named, "hermes"))
    assert "<tool_call>" in hermes and '\\"name\\": \\"f\\"' in hermes
    assert '\\"g\\"' not in hermes
    required = ChatRequest.model_validate(base | {"tool_choice": "required"})
    assert [f["name"] for f in required.forced_functions or []] == ["f", "g"]
    llama = asyncio.run(gateway.grammar(required, "llama3_json"))
    assert '\\"parameters\\"' in llama and "{0,7}" in llama  # several calls, at most 8
    auto = ChatRequest.model_validate(base | {"tool_choice": "auto"})
    assert auto.forced_functions is None and asyncio.run(gateway.grammar(auto, "hermes")) == ""
    assert "{0," not in asyncio.run(gateway.grammar(named.model_copy(  # named: one call
        update={"parallel_tool_calls": True}), "hermes"))
    for parameters, says in (({"type": "object", "properties": {"x": {"type": "nope"}}},
                              "Invalid type: nope"), ({"type": "array"}, "no object schema")):
        bad = ChatRequest.model_validate(base | {"tool_choice": "required", "tools": [
            {"type": "function", "function": {"name": "f", "parameters": parameters}}]})
        with pytest.raises(APIError, match=says) as refused:
            asyncio.run(gateway.grammar(bad, "hermes"))
        assert refused.value.param == "tool_choice"


def test_the_formats_served_each_give_a_grammar() -> None:
    gateway = Gateway(GatewaySettings())
    for body in (schema({"type": "object", "if": {}}), {"guided_choice": ["a", "b"]},
                 {"response_format": {"type": "json_object"}},
                 {"structured_outputs": {"json": '{"type": "integer"}'}},
                 {"structured_outputs": {"grammar": 'start: "x" | "y"'}},
                 {"guided_regex": "[0-9]+"}, schema(_chain(6))):
        asked = ChatRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}]} | body)
        assert asyncio.run(gateway.grammar(asked))
    plain = ChatRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "hi"}], "response_format": {"type": "text"}})
    assert asyncio.run(gateway.grammar(plain)) == ""
