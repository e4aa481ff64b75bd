"""Two gateways in front of the same colocated workers: each counts the other's requests (as
the other publishes them in Redis) where it dispatches, so a request through one goes to the
worker the other has loaded least, not to the one its own counts alone would pick."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from redis import Redis

from distserve.bench.results import span_bounds
from services.launcher import Stack, fixed, module
from services.supervisor import free_port, wait_for_port
from shared import subjects
from tests.services.conftest import start_stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def two_gateways(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, str]]:
    """A stack of 2 colocated workers behind its gateway, and a second gateway's URL."""
    stack = start_stack(tmp_path_factory.mktemp("gateways"), mode="colocated", replicas=2)
    try:
        port = free_port()
        second = stack.supervisor.spawn("gateway-b", module("gateway"), fixed(
            stack.env | {"DS_PORT": str(port), "DS_MODE": "colocated", "DS_GATEWAY_ID": "b"}))
        wait_for_port(port, second, "the second gateway")
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while httpx.get(f"{url}/health", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "the second gateway never saw the workers"
            time.sleep(0.5)
        yield stack, url
    finally:
        stack.stop()


async def first_token(client: openai.AsyncOpenAI, streams: list[object]) -> None:
    """Start a long greedy stream and return once its first text arrives (it is kept open in
    `streams`, so the request stays in flight)."""
    stream = await client.completions.create(
        model=MODEL, prompt="Count from one to one thousand:", max_tokens=1000, temperature=0,
        stream=True, extra_body={"ignore_eos": True})
    streams.append(stream)
    async for chunk in stream:  # type: ignore[attr-defined]
        if chunk.choices and chunk.choices[0].text:
            return


def in_flight(redis: Redis) -> dict[str, dict[str, int]]:
    """{gateway: {worker: requests in flight there}} as the gateways publish them (no
    zeros)."""
    found: dict[str, dict[str, int]] = {}
    for key in redis.keys(subjects.inflight_keys()):
        instance, gateway = subjects.inflight_of(key.decode())
        value = int(redis.get(key) or 0)
        if value:
            found.setdefault(gateway, {})[instance] = value
    return found


def test_a_gateway_sends_a_request_where_the_other_gateway_has_fewest(
        two_gateways: tuple[Stack, str]) -> None:
    stack, second = two_gateways
    redis = Redis.from_url(stack.env["DS_REDIS_URL"], socket_timeout=5)
    first = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused", timeout=300,
                               max_retries=0)
    other = openai.AsyncOpenAI(base_url=f"{second}/v1", api_key="unused", timeout=300,
                               max_retries=0)
    streams: list[object] = []

    async def main() -> tuple[dict[str, int], dict[str, int]]:
        for _ in range(3):  # one after another: the first gateway's own counts split them
            await first_token(first, streams)
        await asyncio.sleep(2)  # both gateways publish and read the counts every 0.5 s
        (held,) = in_flight(redis).values()
        await first_token(other, streams)
        await asyncio.sleep(1)
        sent = in_flight(redis).get("b", {})
        for stream in streams:
            await stream.close()  # type: ignore[attr-defined]
        return held, sent

    held, sent = asyncio.run(main())
    assert sorted(held.values()) == [1, 2], held  # the first gateway: 2 on one worker, 1
    least = min(held, key=lambda w: held[w])
    assert sent == {least: 1}
    assert least != min(held)  # its own counts alone (none there) would pick by name
    deadline = time.monotonic() + 60  # closed streams free their workers: no count is left
    while in_flight(redis):
        assert time.monotonic() < deadline, f"still counted: {in_flight(redis)}"
        time.sleep(0.5)
    redis.close()


def whole_lines(text: str) -> Iterator[dict[str, Any]]:
    """The JSON lines of `text`, but one a service is still writing."""
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            yield json.loads(line)


def test_a_colocated_workers_trace_names_the_stages_a_disaggregated_pair_does(
        two_gateways: tuple[Stack, str]) -> None:
    """A colocated worker's spans: the wait for the step that began the prompt, the prompt's
    run to its first token, the decoding to its end, one after another inside the
    gateway's request span (what `bench compare` puts beside the simulator's stages)."""
    stack, _ = two_gateways
    answer = httpx.post(f"{stack.url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "Trace a colocated worker", "max_tokens": 5,
        "temperature": 0, "ignore_eos": True})
    assert answer.status_code == 200
    request_id = answer.json()["id"].removeprefix("cmpl-")
    stages = ("prefill queue", "prefill run", "decode run")
    found: dict[str, dict[str, object]] = {}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(found) < 1 + len(stages):
        time.sleep(0.5)  # the services flush their spans every 0.5 s
        spans = [span for path in stack.run_dir.glob("traces-*.jsonl")
                 for span in whole_lines(path.read_text())]
        trace = next((s["context"]["trace_id"] for s in spans if s["name"] == "request"
                      and s["attributes"].get("request_id") == request_id), None)
        found = {s["name"]: s for s in spans if s["context"]["trace_id"] == trace
                 and s["name"] in ("request", *stages)}
    assert set(found) == {"request", *stages}, set(found)
    (start, end), *parts = (span_bounds(found[name]) for name in ("request", *stages))
    assert start <= parts[0][0] and parts[-1][1] <= end + 1e-3
    for (_, before), (after, _) in itertools.pairwise(parts):
        assert before == pytest.approx(after, abs=1e-3)  # each stage ends where the next begins
    assert all(b >= a for a, b in parts)
    worker = {found[name]["attributes"]["instance"] for name in stages}  # type: ignore[index]
    assert len(worker) == 1 and worker.pop().startswith("colocated-")
    assert found["prefill run"]["attributes"]["prompt_tokens"] > 0  # type: ignore[index,operator]
    assert found["decode run"]["attributes"]["finish_reason"] == "length"  # type: ignore[index]
