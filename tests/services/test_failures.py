"""Failures: KV nobody pulls, and the launcher's shutdown leaving nothing behind (killed
instances: test_failover.py, test_supervision.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from nats.aio.msg import Msg

from services.launcher import Stack, free_port
from shared import subjects
from shared.bus import connect, publish
from shared.messages import KvWanted, KvWantedReply, PrefillRequest, Sampling
from shared.state import InstanceInfo
from tests.services.conftest import metric, start_stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Stack:
    s = start_stack(tmp_path_factory.mktemp("small"), prefill=1, decode=1)
    yield s  # type: ignore[misc]
    s.stop()


def test_kv_nobody_pulls_is_freed_after_the_lease(small: Stack) -> None:
    total = metric(small.url, "ds_kv_free_blocks")["prefill-0"]

    nats_url = small.env["DS_NATS_URL"]

    async def ghost() -> None:
        nc = await connect(nats_url, "test")
        await publish(nc, subjects.prefill("prefill-0"), PrefillRequest(
            request_id="ghost-1", prompt_ids=list(range(100, 400)),
            sampling=Sampling(max_tokens=8), decode_instance="nobody", arrival_ts=time.time()))
        await nc.flush()
        await nc.close()

    asyncio.run(ghost())
    deadline = time.monotonic() + 10
    while metric(small.url, "ds_kv_free_blocks")["prefill-0"] == total:
        assert time.monotonic() < deadline, "the prefill never held the ghost's KV"
        time.sleep(0.2)
    held = metric(small.url, "ds_kv_free_blocks")["prefill-0"]
    assert held < total  # parked, waiting for a decode instance that does not exist
    deadline = time.monotonic() + 30  # the lease is 4 s in these tests
    while metric(small.url, "ds_kv_free_blocks")["prefill-0"] != total:
        assert time.monotonic() < deadline, "the lease never freed the blocks"
        time.sleep(0.5)


def test_kv_a_live_decode_instance_does_not_want_is_freed(small: Stack) -> None:
    """A decode instance that heartbeats keeps the lease alive, so only asking it frees KV
    whose announcement, release or cancel NATS lost: held while it says it wants the KV,
    freed once it says it does not."""
    total = metric(small.url, "ds_kv_free_blocks")["prefill-0"]
    wants: set[str] = {"lost-1"}
    asked: list[dict[str, int]] = []

    async def fake_decode_instance() -> None:
        nc = await connect(small.env["DS_NATS_URL"], "test")

        async def on_wanted(msg: Msg) -> None:
            query = KvWanted.model_validate_json(msg.data)
            asked.append(query.attempts)
            await msg.respond(KvWantedReply(wanted=[r for r in query.attempts if r in wants])
                              .model_dump_json().encode())

        await nc.subscribe(subjects.wanted("decode-fake"), cb=on_wanted)
        await nc.subscribe(subjects.decode("decode-fake"))  # announced to it, never pulled
        await publish(nc, subjects.prefill("prefill-0"), PrefillRequest(
            request_id="lost-1", prompt_ids=list(range(100, 400)),
            sampling=Sampling(max_tokens=8), decode_instance="decode-fake",
            arrival_ts=time.time(), attempt=2))
        held_since = None
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # a draining decode instance: nothing dispatched
            await publish(nc, subjects.HEARTBEATS, InstanceInfo(
                instance_id="decode-fake", role="decode", draining=True))
            free = metric(small.url, "ds_kv_free_blocks")["prefill-0"]
            if free < total and held_since is None:
                held_since = time.monotonic()
            if held_since is not None and time.monotonic() - held_since > 12:  # 3 leases
                wants.clear()
            if free == total and held_since is not None:
                break
            await asyncio.sleep(0.5)
        await nc.close()
        assert held_since is not None, "the prefill never held the KV"
        assert time.monotonic() - held_since > 12, "freed while its decode instance wanted it"

    asyncio.run(fake_decode_instance())
    assert metric(small.url, "ds_kv_free_blocks")["prefill-0"] == total, "never freed"
    assert asked and all(a == {"lost-1": 2} for a in asked)


def test_up_then_sigterm_leaves_no_process(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "distserve.cli", "up", "--port", str(port),
                             "--run-dir", str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    deadline, said = time.monotonic() + 600, []
    for line in proc.stdout:
        said.append(line)
        if line.startswith("ready:"):
            break
        assert time.monotonic() < deadline, "".join(said)
    assert said and said[-1].startswith("ready:"), \
        f"`up` exited ({proc.wait()}) before it was ready:\n{''.join(said)}{log_tails(tmp_path)}"
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                              text=True).stdout.split()
    assert len(children) == 5  # nats, valkey, prefill, decode, gateway
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    time.sleep(0.5)
    alive = [pid for pid in children if Path(f"/proc/{pid}").exists()
             and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()]
    assert alive == []


def test_up_says_why_a_worker_could_not_start_and_leaves_nothing_behind(tmp_path: Path) -> None:
    env = {**os.environ, "DS_KV_RETENTION_S": "soon"}  # every worker refuses it
    up = subprocess.run([sys.executable, "-m", "distserve.cli", "up", "--port", str(free_port()),
                         "--run-dir", str(tmp_path)], env=env, capture_output=True, text=True,
                        timeout=300)
    assert up.returncode == 1, up.stdout + up.stderr
    assert "the stack did not start: " in up.stderr and "exited while the stack was starting" \
        in up.stderr, up.stderr
    assert "kv_retention_s" in up.stderr and "Traceback" not in up.stderr, up.stderr  # its log
    assert running(tmp_path) == []


def test_ctrl_c_while_the_stack_starts_stops_it(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "distserve.cli", "up", "--port",
                             str(free_port()), "--run-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:  # past any warning printed before
        if line.startswith("starting"):
            break
    deadline = time.monotonic() + 120
    while not running(tmp_path, "services.prefill"):  # stopped while it starts
        assert time.monotonic() < deadline and proc.poll() is None, "no server started"
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    said = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0 and "stopped before the stack was ready" in said, said
    assert "ready:" not in said and running(tmp_path) == []


def running(run_dir: Path, what: str = "") -> list[int]:
    """The processes of a stack run in `run_dir` (its path in their command line, their
    environment or their working directory: valkey's, which rewrites its command line)
    whose command line holds `what`."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv, env = (proc / "cmdline").read_bytes(), (proc / "environ").read_bytes()
            cwd = os.readlink(proc / "cwd").encode()
            if "zombie" in (proc / "status").read_text().lower():
                continue
        except OSError:  # gone meanwhile
            continue
        if str(run_dir).encode() in argv + env + cwd and what.encode() in argv \
                and int(proc.name) != os.getpid():
            found.append(int(proc.name))
    return found


def log_tails(run_dir: Path, lines: int = 30) -> str:
    """The last lines of every log under `run_dir`, for a failure's message."""
    return "".join(f"\n--- {log}:\n" + "\n".join(log.read_text(errors="replace")
                                                  .splitlines()[-lines:])
                   for log in sorted(run_dir.rglob("*.log")))
