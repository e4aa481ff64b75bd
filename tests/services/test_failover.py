"""Failover with real processes killed for real: a decode instance killed mid-stream under
30 concurrent streams, a prefill instance killed with prompts queued on it. Every request
completes with the text an undisturbed run gives; the moves show on /metrics; afterwards
every pool is back to its free count. A decode instance frozen mid-stream (SIGSTOP) is
killed once it has shown no life for the hang timeout, and comes back; so does one whose
engine thread wedges while its heartbeats go on (tests/services/wedge), which gets no new
request meanwhile. And a gateway killed with requests in flight holds up no later drain."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from redis import Redis

from distserve.bench import scrape
from services.launcher import Stack
from services.supervisor import DRAINED
from shared import subjects
from shared.bus import connect, publish
from shared.messages import Drain
from tests.services.conftest import metric, start_stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
MODEL = "smollm2-135m"
HANG_S = 20  # a child whose alive file is this long untouched is killed
STEP_S = 40  # a worker whose engine is this long at one step stops touching it
STALL_S = 30  # a stream this long without progress moves; a stuck instance gets no request
WEDGE_DIR = Path(__file__).parent / "wedge"  # its sitecustomize wedges a worker on demand
THINGS = ["a fox", "the sea", "a robot", "winter", "a lighthouse", "bread", "a violin",
          "the moon", "a garden", "trains", "a cat", "rain", "a castle", "coffee", "a river",
          "mountains", "a library", "snow", "a bicycle", "the desert", "a clock", "bees",
          "a ship", "autumn", "a dragon", "glass", "a forest", "thunder", "a market", "stars"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # imported KV is retained 20 s: a decode instance killed within that resumes from it
    tmp = tmp_path_factory.mktemp("failover")
    s = start_stack(tmp, prefill=2, decode=2,
                    extra_env={"DS_KV_RETENTION_S": "20", "DS_DRAIN_TIMEOUT_S": "300",
                               "DS_HANG_TIMEOUT_S": str(HANG_S), "DS_STEP_TIMEOUT_S": str(STEP_S),
                               "DS_STALL_TIMEOUT_S": str(STALL_S),
                               "PYTHONPATH": os.pathsep.join(
                                   [str(WEDGE_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]),
                               "DS_TEST_WEDGE_FILE": str(tmp / "wedge")})
    yield s
    s.stop()


def moves(url: str) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(labels["cause"], labels["path"]): n
            for labels, n in scrape.samples(text, "ds_request_moves_total")}


async def run_all(url: str, prompts: list[str], max_tokens: int,
                  on_progress: Callable[[int], None] | None = None) -> list[str]:
    """Stream every prompt at once (greedy); the texts, in order. `on_progress` gets the
    number of text chunks received so far, after each one."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300,
                                max_retries=0)
    received = 0

    async def one(prompt: str) -> str:
        nonlocal received
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        text = ""
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                text += chunk.choices[0].text
                received += 1
                if on_progress is not None:
                    on_progress(received)
        return text

    try:
        return list(await asyncio.gather(*(one(p) for p in prompts)))
    finally:
        await client.close()


def wait_until_whole(stack: Stack, prefill: int, decode: int, within_s: float = 180) -> None:
    """Every pool free again, and the expected number of instances live."""
    deadline = time.monotonic() + within_s
    while True:
        free = metric(stack.url, "ds_kv_free_blocks")
        total = metric(stack.url, "ds_kv_total_blocks")
        roles = [name.split("-")[0] for name in free]
        if free == total and roles.count("prefill") == prefill and \
                roles.count("decode") == decode:
            return
        assert time.monotonic() < deadline, f"pools not free: {free} of {total}"
        time.sleep(1)


def busiest(stack: Stack, role: str) -> str:
    """The child running the instance of `role` the gateway has the most requests on."""
    return re.sub(r"-r\d+$", "", busiest_instance(stack, role))


def busiest_instance(stack: Stack, role: str) -> str:
    """The instance of `role` the gateway has the most requests on, by the in-flight counts
    it writes to Redis (a burst spreads by the gateway's counts and the instances' reported
    queues, so which one holds the most is not fixed)."""
    redis = Redis.from_url(stack.env["DS_REDIS_URL"], socket_timeout=5)
    try:
        counts = {k.decode().split(":")[2]: int(redis.get(k) or 0)
                  for k in redis.keys(f"ds:inflight:{role}-*")}
    finally:
        redis.close()
    return max(sorted(counts), key=lambda i: counts[i])


def test_a_decode_instance_killed_mid_stream_loses_no_request(stack: Stack) -> None:
    prompts = [f"Write a short story about {thing}." for thing in THINGS]
    undisturbed = asyncio.run(run_all(stack.url, prompts, max_tokens=40))
    assert all(undisturbed)
    before = sum(moves(stack.url).values())
    killed: list[str] = []

    def kill_once(received: int) -> None:
        if received >= 4 * len(prompts) and not killed:  # every stream is well under way
            victim = busiest(stack, "decode")
            stack.child(victim).send_signal(signal.SIGKILL)
            killed.append(victim)

    texts = asyncio.run(run_all(stack.url, prompts, max_tokens=40, on_progress=kill_once))
    assert killed, "the decode instance was never killed"
    assert texts == undisturbed  # every request completed, with the same text
    moved = moves(stack.url)
    by_death = sum(n for (cause, _), n in moved.items() if cause == "decode_died")
    assert by_death >= 1 and sum(moved.values()) > before
    assert moved.get(("decode_died", "kv_held"), 0) >= 1  # resumed from the retained KV
    wait_until_whole(stack, prefill=2, decode=2)  # the killed one restarted; nothing leaked
    assert stack.restarts()[killed[0]] >= 1


def test_a_prefill_instance_killed_with_prompts_queued_loses_no_request(stack: Stack) -> None:
    wait_until_whole(stack, prefill=2, decode=2)
    # about 480 tokens each: one prompt a prefill step, so most are queued at the first token
    prompts = [f"Summarize the history of {thing}. " * 60 for thing in THINGS[:16]]
    undisturbed = asyncio.run(run_all(stack.url, prompts, max_tokens=8))
    killed = []

    def kill_at_first_token(received: int) -> None:  # the rest are queued
        if not killed:
            stack.child(busiest(stack, "prefill")).send_signal(signal.SIGKILL)
            killed.append(time.monotonic())

    texts = asyncio.run(run_all(stack.url, prompts, max_tokens=8,
                                on_progress=kill_at_first_token))
    assert killed
    assert texts == undisturbed
    moved = moves(stack.url)  # queued there, or parked there with the pull failing
    assert sum(n for (cause, _), n in moved.items()
               if cause in ("prefill_died", "kv_transfer")) >= 1
    wait_until_whole(stack, prefill=2, decode=2)


def test_a_decode_instance_frozen_mid_stream_is_killed_and_replaced(
        stack: Stack, caplog: pytest.LogCaptureFixture) -> None:
    """SIGSTOP neither ends a process nor lets it answer: its streams move on once its
    heartbeats stop, and the supervisor kills it once it has left its alive file untouched
    for HANG_S, so its memory is not held for ever; it comes back under a new id."""
    caplog.set_level(logging.WARNING, logger="services.supervisor")
    wait_until_whole(stack, prefill=2, decode=2)
    prompts = [f"Write a short story about {thing}." for thing in THINGS[:8]]
    undisturbed = asyncio.run(run_all(stack.url, prompts, max_tokens=40))
    frozen: list[tuple[str, subprocess.Popen[bytes], float]] = []

    def freeze_once(received: int) -> None:
        if received >= 4 * len(prompts) and not frozen:
            victim = busiest(stack, "decode")
            proc = stack.child(victim)
            proc.send_signal(signal.SIGSTOP)
            frozen.append((victim, proc, time.time()))

    try:
        texts = asyncio.run(run_all(stack.url, prompts, max_tokens=40,
                                    on_progress=freeze_once))
        assert frozen, "no decode instance was frozen"
        assert texts == undisturbed  # moved off the frozen instance, with the same text
        victim, proc, at = frozen[0]
        assert proc.wait(timeout=HANG_S + 60) == -signal.SIGKILL
    finally:
        for _, proc, _ in frozen:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
    wait_until_whole(stack, prefill=2, decode=2)  # restarted; its KV went with the process
    assert stack.child(victim).pid != proc.pid
    (killed,) = [r for r in caplog.records
                 if r.getMessage().startswith(f"{victim} has not shown it is alive for ")]
    # not before its timeout (counted from its last touch, up to a second before the freeze)
    assert killed.created - at >= HANG_S - 1.5


def test_a_decode_instance_whose_engine_wedges_is_left_then_killed_and_replaced(
        stack: Stack, caplog: pytest.LogCaptureFixture) -> None:
    """An engine step that never returns, the GIL released (a native kernel, a KV export that
    hangs): the worker's event loop and heartbeats go on, so nothing looks dead. Its streams
    move to the other decode instance once it is stuck (DS_STUCK_AFTER_S, 10 s), not after
    the stall timeout; requests sent while it stays wedged go elsewhere at once; past
    DS_STEP_TIMEOUT_S it stops touching its alive file, its supervisor kills it
    DS_HANG_TIMEOUT_S later, and it comes back."""
    caplog.set_level(logging.WARNING, logger="services.supervisor")
    wait_until_whole(stack, prefill=2, decode=2)
    prompts = [f"Write a short story about {thing}." for thing in THINGS[8:16]]
    undisturbed = asyncio.run(run_all(stack.url, prompts, max_tokens=40))
    wedge = Path(stack.env["DS_TEST_WEDGE_FILE"])
    assert stack.env["DS_STALL_TIMEOUT_S"] == str(STALL_S)
    wedged: list[tuple[str, subprocess.Popen[bytes], float]] = []

    def wedge_once(received: int) -> None:
        if received >= 4 * len(prompts) and not wedged:
            victim = busiest_instance(stack, "decode")
            wedge.write_text(victim)
            wedged.append((victim, stack.child(re.sub(r"-r\d+$", "", victim)), time.time()))

    before = moves(stack.url)
    try:
        texts = asyncio.run(run_all(stack.url, prompts, max_tokens=40, on_progress=wedge_once))
        assert wedged, "no decode instance was wedged"
        assert texts == undisturbed  # moved off the wedged instance, with the same text
        victim, proc, at = wedged[0]
        moved = {cause for (cause, path), n in moves(stack.url).items()
                 if n > before.get((cause, path), 0)}
        assert "stuck" in moved and "stalled" not in moved, moved  # not after STALL_S
        assert proc.poll() is None  # still wedged (killed STEP_S + HANG_S after the wedge)
        health = httpx.get(f"{stack.url}/health", timeout=10).json()
        assert health["stuck_ids"] == [victim] and victim in health["instance_ids"]
        assert metric(stack.url, "ds_engine_stuck_seconds")[victim] > 10
        before = moves(stack.url)
        started = time.monotonic()
        again = asyncio.run(run_all(stack.url, prompts, max_tokens=40))
        took = time.monotonic() - started
        assert again == undisturbed
        assert proc.poll() is None, "the wedged instance was killed before the second round"
        # none of them was sent to the wedged instance (to wait STALL_S there, then move)
        assert moves(stack.url) == before, f"second round in {took:.0f} s"
        assert proc.wait(timeout=STEP_S + HANG_S + 60) == -signal.SIGKILL
    finally:
        wedge.unlink(missing_ok=True)
    wait_until_whole(stack, prefill=2, decode=2)  # restarted; its KV went with the process
    child = re.sub(r"-r\d+$", "", victim)
    assert stack.child(child).pid != proc.pid
    (killed,) = [r for r in caplog.records
                 if r.getMessage().startswith(f"{child} has not shown it is alive for ")]
    assert killed.created - at >= STEP_S + HANG_S - 1.5  # by the step timeout, not sooner


def test_a_request_sent_while_the_gateway_restarts_waits_for_it_instead_of_failing(
        stack: Stack) -> None:
    """The gateway serves on a socket the launcher bound and keeps: while a killed gateway is
    restarted, a client's connection waits in that socket's backlog (not refused)."""
    wait_until_whole(stack, prefill=2, decode=2)
    killed = stack.child("gateway")
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=30)
    reply = httpx.post(f"{stack.url}/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": "Once upon a time", "max_tokens": 4})
    assert reply.status_code == 200, reply.text
    assert stack.child("gateway").pid != killed.pid  # answered by the gateway's next life
    assert stack.restarts()["gateway"] >= 1


def test_a_gateway_killed_with_requests_in_flight_delays_no_drain(stack: Stack) -> None:
    """The dead gateway's in-flight counts expire with it: draining an instance it had
    requests on waits for those requests, not for the drain timeout (300 s here)."""
    wait_until_whole(stack, prefill=2, decode=2)
    prompts = [f"Write a short story about {thing}." for thing in THINGS[:12]]
    redis = Redis.from_url(stack.env["DS_REDIS_URL"], socket_timeout=5)
    counted: list[str] = []  # decode instances the gateway had requests on when it died

    async def stream_then_kill() -> None:
        def kill_once(received: int) -> None:
            # once streams are under way and the gateway has published its decode counts
            # (every 0.5 s: two decode steps can stream 24 chunks before the first)
            if received >= 24 and not counted:
                counted.extend(sorted({k.decode().split(":")[2]
                                       for k in redis.keys("ds:inflight:decode-*")}))
                if counted:
                    stack.child("gateway").send_signal(signal.SIGKILL)

        with contextlib.suppress(openai.APIError, httpx.HTTPError):
            await run_all(stack.url, prompts, max_tokens=200, on_progress=kill_once)

    asyncio.run(stream_then_kill())
    assert counted, "the gateway was never killed with counts in Redis"
    instance = counted[0]  # the dead gateway's counts for it are still there, or expiring
    drained = time.monotonic()
    asyncio.run(drain(instance, stack.env["DS_NATS_URL"]))
    assert stack.child(re.sub(r"-r\d+$", "", instance)).wait(timeout=120) == DRAINED
    assert time.monotonic() - drained < 100  # not the drain timeout
    assert redis.keys(subjects.inflight_keys(instance)) == []
    redis.close()


async def drain(instance: str, nats_url: str) -> None:
    nc = await connect(nats_url, "test")
    await publish(nc, subjects.drain(instance), Drain(reason="test"))
    await nc.flush()
    await nc.close()
