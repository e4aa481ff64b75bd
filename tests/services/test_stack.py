"""The disaggregated stack end to end: separate processes for the gateway, 2 prefill and 2
decode instances, real nats-server and valkey-server, KV over UCX. The decode instances run
int4 weights (the GGUF's own Q4_1 blocks, the very weights the float32 prefill instances
dequantized), so every greedy text below is also float32's: each phase its precision."""

from __future__ import annotations

import concurrent.futures
import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from distserve.bench.results import span_bounds
from services.launcher import Stack
from shared.engine.engine import Engine
from tests.services.conftest import greedy, metric, metric_when, metrics, start_stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
MODEL = "smollm2-135m"
PROMPTS = ["The capital of France is", "def add(a, b):", "The three primary colors are",
           "Once upon a time", "Water boils at", "import numpy as np\n"]


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", timeout=120)


def test_each_decode_instance_connects_to_every_prefill_instance_on_its_own(
        stack: Stack) -> None:
    """The endpoints a first pull would otherwise wait for are opened once the registry
    lists the prefill instances, before any request (the module's first test: a pull that
    opened one first would leave nothing to open ahead, and nothing logged)."""
    deadline = time.monotonic() + 60
    while True:
        logs = {d: (stack.run_dir / f"{d}.log").read_text() for d in ("decode-0", "decode-1")}
        if all(f"KV endpoint to {p} " in log for log in logs.values()
               for p in ("prefill-0", "prefill-1")) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for decode, log in logs.items():
        assert "KV endpoint to prefill-0 " in log and "KV endpoint to prefill-1 " in log, \
            (decode, log[-2000:])


def test_openai_client_completions_and_chat(stack: Stack, engine: Engine) -> None:
    c = client(stack)
    assert engine.tokenizer is not None
    expected = greedy(engine, engine.tokenizer.encode(PROMPTS[0]), 12)
    r = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert r.choices[0].text == expected
    assert r.usage is not None and r.usage.completion_tokens == 12
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True)
        if ch.choices)
    assert streamed == expected
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat_ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages))
    expected_chat = greedy(engine, chat_ids, 20)
    r2 = c.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                   max_tokens=20, temperature=0)
    assert r2.choices[0].message.content == expected_chat
    assert r2.choices[0].finish_reason in ("stop", "length")
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages,  # type: ignore
                                            max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == \
        expected_chat
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == len(chat_ids)
    assert [m.id for m in c.models.list().data] == [MODEL]


def test_concurrent_streams_across_instances(stack: Stack, engine: Engine) -> None:
    assert engine.tokenizer is not None
    expected = [greedy(engine, engine.tokenizer.encode(p), 16) for p in PROMPTS]
    before = metric(stack.url, "ds_kv_transfer_requests_total")

    def stream(prompt: str) -> str:
        return "".join(ch.choices[0].text for ch in client(stack).completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True)
            if ch.choices)

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        assert list(pool.map(stream, PROMPTS)) == expected
    # float32 prefill instances handed their KV to int4 decode instances
    logs = {c.name: Path(c.log).read_text() for c in stack.children
            if c.name.startswith(("prefill", "decode"))}
    assert len(logs) == 4
    assert all(("(int4 weights, float32" if name.startswith("decode")
                else "(auto weights, float32") in text for name, text in logs.items()), logs
    # the counts may lag the streams (a CI run read 4 of 6 on both sides): read them until
    # they agree and count every request, for a while
    def since(after: dict[str, float], role: str) -> dict[str, float]:
        return {i: after[i] - before.get(i, 0) for i in after if i.startswith(role)}

    after = metric_when(stack.url, "ds_kv_transfer_requests_total", lambda a: sum(
        since(a, "prefill").values()) == sum(since(a, "decode").values()) >= len(PROMPTS))
    pulled, served = since(after, "decode"), since(after, "prefill")
    assert sum(pulled.values()) >= len(PROMPTS)  # every request's KV crossed over UCX
    assert len([i for i, n in pulled.items() if n > 0]) == 2  # both decode instances served
    assert sum(served.values()) == sum(pulled.values())
    bytes_ = metric(stack.url, "ds_kv_transfer_bytes_total")
    assert sum(v for i, v in bytes_.items() if i.startswith("decode")) > 0
    # the engine loops report their steps: each decode step ran at least one request (one
    # read of /metrics: figures of different heartbeats need not add up)
    steps, batched, seconds, cpu, queued = metrics(
        stack.url, "ds_engine_steps_total", "ds_engine_batched_requests_total",
        "ds_engine_step_seconds_total", "ds_engine_step_cpu_seconds_total",
        "ds_engine_step_queued_seconds_total").values()
    decoding = [i for i in steps if i.startswith("decode") and steps[i] > 0]
    assert len(decoding) == 2
    assert all(batched[i] >= steps[i] and seconds[i] > 0 for i in decoding)
    # the step time splits into the engine thread's CPU time and its wait for a CPU
    assert all(cpu[i] > 0 and cpu[i] + queued[i] <= seconds[i] * 1.05 + 0.01 for i in decoding)


def all_free(url: str) -> bool:
    free, total = metric(url, "ds_kv_free_blocks"), metric(url, "ds_kv_total_blocks")
    return len(free) == 4 and free == total


def test_cancel_mid_stream_frees_kv_everywhere(stack: Stack) -> None:
    stream = client(stack).completions.create(model=MODEL, prompt=PROMPTS[3] * 20,
                                              max_tokens=400, temperature=0, stream=True,
                                              extra_body={"ignore_eos": True})
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].text)
        if got >= 3:
            break
    held = metric(stack.url, "ds_kv_free_blocks")
    stream.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 30
    while not all_free(stack.url):
        assert time.monotonic() < deadline, (held, metric(stack.url, "ds_kv_free_blocks"))
        time.sleep(0.5)


@pytest.mark.parametrize(("body", "status", "message"), [
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "gpt-9", "prompt": "hi"}, 404, "does not exist"),
    ({"model": MODEL, "prompt": "hi", "n": 129}, 400, "less than or equal to 128"),
    ({"model": MODEL, "prompt": "hi", "temperature": 7}, 400, "temperature"),
    ({"model": MODEL, "prompt": "hi " * 9000, "max_tokens": 5}, 400, "maximum context length"),
    ({"model": MODEL, "prompt": ""}, 400, "empty"),
    ({"prompt": "hi"}, 400, "model"),
    ({"model": MODEL, "prompt": "hi", "best_of": 3}, 400, "best_of"),
])
def test_bad_inputs_get_openai_shaped_4xx(stack: Stack, body: dict[str, object], status: int,
                                          message: str) -> None:
    r = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == status
    error = r.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"


def test_malformed_json_then_still_serving(stack: Stack) -> None:
    r = httpx.post(f"{stack.url}/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    ok = client(stack).completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert ok.usage is not None and ok.usage.completion_tokens == 2


def test_one_trace_spans_gateway_prefill_transfer_and_decode(stack: Stack) -> None:
    c = client(stack)
    c.completions.create(model=MODEL, prompt="Trace me", max_tokens=4, temperature=0,
                         user="trace-test")
    spans: list[dict[str, object]] = []
    deadline = time.monotonic() + 20
    needed = {"request", "prefill queue", "prefill run", "decode queue", "kv transfer",
              "kv export", "decode run"}
    while time.monotonic() < deadline:
        spans = [json.loads(line) for path in stack.run_dir.glob("traces-*.jsonl")
                 for line in path.read_text().splitlines()]
        requests = [s for s in spans if s["name"] == "request"]
        if requests:
            trace_id = requests[-1]["context"]["trace_id"]  # type: ignore[index]
            names = {s["name"] for s in spans
                     if s["context"]["trace_id"] == trace_id}  # type: ignore[index]
            if needed <= names:
                break
        time.sleep(0.5)
    assert needed <= names, names
    transfer, export = (next(s for s in spans if s["name"] == name
                             and s["context"]["trace_id"] == trace_id)  # type: ignore[index]
                        for name in ("kv transfer", "kv export"))
    assert transfer["attributes"]["bytes"] > 0  # type: ignore[index,operator]
    # the prefill side's view of the same pull: its bytes, asked for during the decode
    # side's span (where each side's last byte counts as done may differ: not compared)
    assert export["attributes"]["bytes"] == transfer["attributes"]["bytes"]  # type: ignore[index]
    (pulled, landed), (asked, sent) = (span_bounds(s) for s in (transfer, export))  # type: ignore[arg-type]
    assert pulled <= asked <= landed and asked <= sent
    assert 0 <= export["attributes"]["copy_s"] <= sent - asked + 1e-6  # type: ignore[index,operator]


def test_a_bfloat16_prefill_instance_hands_float32_kv_to_the_decode_instance(
        tmp_path: Path, engine: Engine) -> None:
    """`up --prefill-dtype bfloat16`: the prefill instance computes in bfloat16 and keeps
    its KV in float32, the pool the float32 decode instance pulls over UCX and continues.
    bfloat16's rounding may flip a near tie (in-process, "def add(a, b):"'s first token
    does), so most, not all, texts are float32's; KV read wrongly would match none."""
    stack = start_stack(tmp_path, prefill=1, decode=1, prefill_dtype="bfloat16")
    try:
        assert engine.tokenizer is not None
        expected = [greedy(engine, engine.tokenizer.encode(p), 16) for p in PROMPTS]
        got = [client(stack).completions.create(model=MODEL, prompt=p, max_tokens=16,
                                                temperature=0) for p in PROMPTS]
        assert all(r.usage is not None and r.usage.completion_tokens == 16 for r in got)
        same = sum(r.choices[0].text == text for r, text in zip(got, expected, strict=True))
        print(f"bfloat16 prefill, float32 decode: {same} of {len(PROMPTS)} texts as float32's")
        assert same >= len(PROMPTS) - 2
        logs = {c.name: Path(c.log).read_text() for c in stack.children}
        assert "(auto weights, bfloat16, KV in float32)" in logs["prefill-0"]
        assert "(auto weights, float32, KV in float32)" in logs["decode-0"]
        pulled = metric_when(stack.url, "ds_kv_transfer_requests_total",
                             lambda a: a.get("decode-0", 0) >= len(PROMPTS))
        assert pulled["decode-0"] >= len(PROMPTS)  # every request's KV crossed over UCX
    finally:
        stack.stop()
