"""Outages of what the services talk through, and a frozen worker, under load, with real
processes: Valkey frozen 10 s, Valkey and nats-server killed (the supervisor starts them
again), a prefill instance frozen (SIGSTOP) while decode instances pull from it. No worker
exits; no request hangs; every request completes or fails with a clear error; afterwards
the stack serves again."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import openai
import pytest
from redis import Redis

from services.launcher import SERVERS, Stack
from services.supervisor import wait_for_port
from shared import subjects
from tests.services.conftest import start_stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
MODEL = "smollm2-135m"
STALL_S = 20  # the gateway's stall timeout in these stacks
PULL_TIMEOUT_S = 3


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # a frozen worker resumed is the point of one test here: none is killed as hung
    s = start_stack(tmp_path_factory.mktemp("outages"), prefill=2, decode=2, extra_env={
        "DS_STALL_TIMEOUT_S": str(STALL_S), "DS_KV_PULL_TIMEOUT_S": str(PULL_TIMEOUT_S),
        "DS_HANG_TIMEOUT_S": "0"})
    yield s
    s.stop()


@dataclass
class Load:
    """`users` clients, each streaming one request after another until stopped, on a thread
    of its own. Every request ends as "ok" or as the error it got; none may hang (each is
    bounded by the client's timeout, far beyond the stall timeout)."""

    url: str
    users: int = 6
    outcomes: list[tuple[float, float, str]] = field(default_factory=list)  # start, end, what
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Load:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(timeout=4 * STALL_S + 120)
        assert not self._thread.is_alive(), "a request hung"

    async def _run(self) -> None:
        client = openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused",
                                    timeout=3 * STALL_S + 60, max_retries=0)

        async def user(i: int) -> None:
            n = 0
            while not self._stop.is_set():
                n += 1
                start = time.monotonic()
                try:
                    stream = await client.completions.create(
                        model=MODEL, prompt=f"User {i} asks question {n}: why is the sky blue?",
                        max_tokens=24, temperature=0, stream=True,
                        extra_body={"ignore_eos": True})
                    finish = None
                    async for chunk in stream:
                        if chunk.choices and chunk.choices[0].finish_reason:
                            finish = chunk.choices[0].finish_reason
                    what = "ok" if finish else "no finish"
                except openai.APIError as e:
                    what = f"error: {e}"
                self.outcomes.append((start, time.monotonic(), what))

        await asyncio.gather(*(user(i) for i in range(self.users)))
        await client.close()

    def ok_since(self, t: float) -> int:
        return sum(1 for start, _, what in self.outcomes if start >= t and what == "ok")

    def wait_ok(self, count: int, since: float, within_s: float = 120) -> None:
        deadline = time.monotonic() + within_s
        while self.ok_since(since) < count:
            assert time.monotonic() < deadline, f"the stack did not serve again: " \
                                                f"{self.outcomes[-5:]}"
            time.sleep(0.5)


def health(stack: Stack) -> dict[str, object]:
    response = httpx.get(f"{stack.url}/health", timeout=10)
    return dict(response.json())


def wait_healthy(stack: Stack, within_s: float = 90) -> None:
    deadline = time.monotonic() + within_s
    while health(stack).get("status") != "ok" or \
            health(stack).get("instances") != {"prefill": 2, "decode": 2}:
        assert time.monotonic() < deadline, health(stack)
        time.sleep(0.5)


def no_worker_exited(stack: Stack) -> None:
    """No child restarted but the servers (killed on purpose), and every one running."""
    restarted = {name: n for name, n in stack.supervisor.restarts().items()
                 if n and name not in SERVERS}
    tails = {name: (stack.run_dir / f"{name}.log").read_text(errors="replace")[-3000:]
             for name in restarted}
    assert not restarted, f"restarted: {restarted}; their logs end: {tails}"
    assert all(c.proc.poll() is None for c in stack.supervisor.children)


def restart_server(stack: Stack, name: str) -> None:
    """Kill a server (nats or valkey) and wait until the supervisor has started it again
    with the same command line: the same port and credentials."""
    child = next(c for c in stack.supervisor.children if c.name == name)
    before = stack.restarts()[name]
    child.proc.send_signal(signal.SIGKILL)
    child.proc.wait(timeout=10)
    deadline = time.monotonic() + 60
    while stack.restarts()[name] == before:
        assert time.monotonic() < deadline, f"{name} was not restarted"
        time.sleep(0.1)
    port = int(child.argv[child.argv.index("--port" if name == "valkey" else "-p") + 1])
    wait_for_port(port, stack.child(name), name)


def test_valkey_frozen_for_10s_under_load(stack: Stack) -> None:
    wait_healthy(stack)
    valkey = stack.child("valkey")
    with Load(stack.url) as load:
        load.wait_ok(6, since=0)
        valkey.send_signal(signal.SIGSTOP)
        try:
            time.sleep(10)
        finally:
            valkey.send_signal(signal.SIGCONT)
        resumed = time.monotonic()
        load.wait_ok(12, since=resumed)
    assert [o for o in load.outcomes if o[2] != "ok"] == []  # dispatch never needed Redis
    no_worker_exited(stack)
    wait_healthy(stack)


def test_valkey_restarted_instances_register_again(stack: Stack) -> None:
    wait_healthy(stack)
    restart_server(stack, "valkey")
    redis = Redis.from_url(stack.env["DS_REDIS_URL"], socket_timeout=5)
    deadline = time.monotonic() + 30
    while {m.decode() for role in ("prefill", "decode")
           for m in redis.smembers(subjects.role_set(role))} != \
            {"prefill-0", "prefill-1", "decode-0", "decode-1"}:
        assert time.monotonic() < deadline, "the instances never registered again"
        time.sleep(0.5)
    redis.close()
    no_worker_exited(stack)


def test_nats_restarted_under_load(stack: Stack) -> None:
    wait_healthy(stack)
    with Load(stack.url) as load:
        load.wait_ok(6, since=0)
        cut = time.monotonic()
        restart_server(stack, "nats")
        wait_healthy(stack)
        load.wait_ok(12, since=time.monotonic())  # later requests complete
    during = [o for o in load.outcomes if o[1] >= cut]
    assert during, "no request overlapped the restart"
    for start, end, what in during:  # each completed, or failed clearly and in bounded time
        assert what == "ok" or what.startswith("error: "), what
        assert end - start < 3 * STALL_S + 30
    no_worker_exited(stack)


def test_a_frozen_prefill_instance_costs_no_request(stack: Stack) -> None:
    """SIGSTOP prefill-0 under load: pulls from it time out, its requests move to
    prefill-1 (or fail clearly), decode instances keep serving the others; resumed, it
    serves again."""
    wait_healthy(stack)
    prefill = stack.child("prefill-0")
    with Load(stack.url, users=8) as load:
        load.wait_ok(8, since=0)
        frozen = time.monotonic()
        os.kill(prefill.pid, signal.SIGSTOP)
        try:
            load.wait_ok(16, since=frozen + 1, within_s=180)  # served meanwhile, by the rest
        finally:
            os.kill(prefill.pid, signal.SIGCONT)
        wait_healthy(stack)
        load.wait_ok(8, since=time.monotonic())
    failed = [o for o in load.outcomes if o[2] != "ok"]
    assert all(what.startswith("error: ") for _, _, what in failed), failed
    assert len(failed) <= 2, failed  # moved, not failed: at most a clear error or two
    no_worker_exited(stack)
