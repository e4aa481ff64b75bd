"""A gateway killed (SIGKILL) with long streams in flight: the workers cancel its requests
once its lease lapses, so every KV pool is whole again long before those requests would have
ended, and the gateway the supervisor restarted serves. They used to run to max_tokens with
nobody listening (a fault trial: 97 s with 204 of 364 decode blocks taken)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from services.launcher import Stack
from tests.services.conftest import metric, metric_when, metrics, start_stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
MODEL = "smollm2-135m"
LEASE_S = 3
STREAMS = 3
# near what one request fits in a pool (5,824 tokens), which cannot hold all three: minutes
# to their end (36 tokens/s each on a 2-core EPYC VM); the lease cancels them ~9 s after
# the kill
MAX_TOKENS = 5000


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("lease"), prefill=1, decode=1,
                    extra_env={"DS_GATEWAY_LEASE_S": str(LEASE_S)})
    yield s
    s.stop()


def pools_whole(url: str) -> bool:
    """Every instance's KV blocks free (False while the restarted gateway is not serving)."""
    try:
        reading = metrics(url, "ds_kv_free_blocks", "ds_kv_total_blocks")
    except httpx.HTTPError:
        return False
    free, total = reading["ds_kv_free_blocks"], reading["ds_kv_total_blocks"]
    return len(total) == 2 and free == total


async def stream_then_kill(stack: Stack, total: dict[str, float]) -> dict[str, float]:
    """Start the long streams, and once each is decoding, SIGKILL the gateway; the
    instances' free blocks just before."""
    client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused", timeout=300,
                                max_retries=0)
    received = [0] * STREAMS
    decoding = asyncio.Event()

    async def one(i: int) -> None:
        stream = await client.completions.create(
            model=MODEL, prompt=f"Count the days of the year {i}:", max_tokens=MAX_TOKENS,
            temperature=0, stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                received[i] += 1
                if min(received) >= 3:  # every stream past its first tokens: on decode
                    decoding.set()

    streams = [asyncio.ensure_future(one(i)) for i in range(STREAMS)]
    try:
        await asyncio.wait_for(decoding.wait(), 300)
        held = await asyncio.to_thread(  # as the heartbeats show it (every 0.5 s)
            metric_when, stack.url, "ds_kv_free_blocks",
            lambda free: any(free[i] < total[i] for i in free if i.startswith("decode-")))
        stack.child("gateway").send_signal(signal.SIGKILL)
        with contextlib.suppress(openai.APIError, httpx.HTTPError):
            await asyncio.gather(*streams)  # they fail with the gateway
        return held
    finally:
        for task in streams:
            task.cancel()
        await client.close()


def test_a_killed_gateways_requests_are_cancelled_once_its_lease_lapses(stack: Stack) -> None:
    total = metric(stack.url, "ds_kv_total_blocks")
    killed_pid = stack.child("gateway").pid
    held = asyncio.run(stream_then_kill(stack, total))
    killed = time.monotonic()
    (decode,) = [i for i in held if i.startswith("decode-")]
    assert held[decode] < total[decode], "the streams held no decode blocks when killed"

    # the key's 5 s expiry, the lease, a reading's interval, a restart, heartbeats: ~15 s;
    # MAX_TOKENS would take minutes
    while not pools_whole(stack.url):
        assert time.monotonic() - killed < 60, "the killed gateway's requests still hold KV"
        time.sleep(0.5)
    log = (stack.supervisor.log_dir / "decode-0.log").read_text()
    assert re.search(rf"gateway \S+ is gone \(no heartbeat for \d+ s\): cancelled {STREAMS} "
                     "requests", log), log[-3000:]

    reply = httpx.post(f"{stack.url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "Once upon a time", "max_tokens": 4})
    assert reply.status_code == 200, reply.text
    assert stack.child("gateway").pid != killed_pid and stack.restarts()["gateway"] >= 1
