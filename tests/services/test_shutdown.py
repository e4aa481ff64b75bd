"""How children stop: in the stack's order, draining, at once when asked twice, and with
their supervisor even when it is killed; and servers that come back on their own. Real
processes throughout (stand-ins for the services, real nats and valkey); the one test that
starts a real stack is marked slow."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from services.launcher import (
    Stack,
    StackConfig,
    drain_timeout,
    fixed,
    listener,
    nats_problem,
    redis_problem,
    shutdown_order,
)
from services.supervisor import Backoff, Restart, Supervisor, free_port, wait_for_port

pytestmark = pytest.mark.timeout(120)
FAST = Backoff(first_s=0.05, max_s=0.4, stable_s=60.0)
# a service's stand-in: says "<name> up"; on SIGTERM closes the socket it inherited
# (DS_LISTEN_FD, as the gateway does), says "<name> stopping", takes DELAY s, says "<name>
# stopped"
STAND_IN = """import os, signal, socket, sys, time
name, events = sys.argv[1], sys.argv[2]
def say(what):
    with open(events, "a") as f: f.write(f"{name} {what}\\n")
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
held = socket.socket(fileno=int(os.environ["DS_LISTEN_FD"])) if "DS_LISTEN_FD" in os.environ \\
    else None
say("up")
signal.sigwait({signal.SIGTERM})
if held is not None: held.close()
say("stopping")
time.sleep(float(os.environ.get("DELAY", "0")))
say("stopped")
"""


def wait_until(condition: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def gone(pid: int) -> bool:
    """Not running: no such process, or a zombie nobody has reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


# --- the order and the drain's bound, as decided ---

def test_the_gateway_stops_first_and_the_servers_last() -> None:
    names = ["nats", "valkey", "gateway", "prefill-0", "decode-0", "profiler", "planner",
             "gateway-b"]
    assert shutdown_order(names) == (["gateway", "gateway-b"],
                                     ["prefill-0", "decode-0", "profiler", "planner"],
                                     ["nats", "valkey"])


def test_a_stack_drains_as_long_as_its_workers_do(tmp_path: Path) -> None:
    assert drain_timeout({}) == 120.0  # the workers' default (WorkerSettings)
    assert drain_timeout({"DS_DRAIN_TIMEOUT_S": "300"}) == 300.0
    assert drain_timeout({"DS_DRAIN_TIMEOUT_S": "soon"}) == 120.0  # the workers refuse it
    stack = Stack(StackConfig(run_dir=tmp_path, extra_env={"DS_DRAIN_TIMEOUT_S": "300"}))
    assert stack.drain_s == 300.0


def test_workers_a_planner_drains_are_restarted_on_a_crash_only() -> None:
    assert StackConfig().worker_restart() is Restart.ALWAYS
    assert StackConfig(planner=True).worker_restart() is Restart.ON_CRASH


# --- a stack's children stopping, stand-ins for its services ---

def test_a_stack_stops_its_gateway_then_its_workers_then_its_servers(tmp_path: Path) -> None:
    """Each waits for the one before to finish (the gateway its streams), none killed though
    the gateway takes longer than a worker; a client connecting once the gateway has closed
    its socket is refused, not left in a backlog nobody accepts from."""
    stack = Stack(StackConfig(port=free_port(), run_dir=tmp_path))
    stack._listener = listener(stack.config.port)  # as start() binds it
    fd, events = stack._listener.fileno(), tmp_path / "events"
    names = ["nats", "valkey", "gateway", "prefill-0", "decode-0"]
    for name in names:
        env = {"DELAY": "1.5" if name == "gateway" else "0.5"}
        if name == "gateway":
            env["DS_LISTEN_FD"] = str(fd)
        stack.supervisor.spawn(name, [sys.executable, "-c", STAND_IN, name, str(events)],
                               fixed(env), restart=Restart.ALWAYS,
                               pass_fds=(fd,) if name == "gateway" else ())
    wait_until(lambda: len(lines(events)) == len(names), "every child to start")
    procs = [stack.child(name) for name in names]
    stopping = threading.Thread(target=stack.stop, kwargs={"drain_s": 60})
    stopping.start()
    wait_until(lambda: "gateway stopping" in lines(events), "the gateway to stop")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", stack.config.port), timeout=5).close()
    stopping.join(timeout=60)
    said = lines(events)
    assert [p.returncode for p in procs] == [0] * len(names)  # none killed, none restarted
    assert said.index("gateway stopped") < min(said.index(f"{w} stopping")
                                               for w in ("prefill-0", "decode-0"))
    assert max(said.index(f"{w} stopped") for w in ("prefill-0", "decode-0")) < \
        min(said.index(f"{s} stopping") for s in ("nats", "valkey"))
    assert stack.children == []


def test_stop_now_kills_what_a_stop_waits_for(tmp_path: Path) -> None:
    """A second Ctrl-C: the drain is not waited for."""
    supervisor = Supervisor(tmp_path, FAST, poll_s=0.05)
    events = tmp_path / "events"
    slow = supervisor.spawn("gateway", [sys.executable, "-c", STAND_IN, "gateway", str(events)],
                            lambda _: {**os.environ, "DELAY": "60"})
    wait_until(lambda: lines(events) == ["gateway up"], "the child to start")
    threading.Timer(0.5, supervisor.stop_now).start()
    started = time.monotonic()
    supervisor.stop(grace=60)
    assert time.monotonic() - started < 20 and slow.returncode == -signal.SIGKILL
    late = supervisor.spawn("late", [sys.executable, "-c", "import time; time.sleep(60)"])
    supervisor.stop(grace=60)  # after stop_now: killed without a SIGTERM first
    assert late.returncode == -signal.SIGKILL


def test_a_child_the_monitor_restarted_is_stopped_gracefully_too(tmp_path: Path) -> None:
    """A child dies with the thread that spawned it: the monitor, which restarts children,
    lives until the last one has exited, so a stop's SIGTERM is not cut short by a SIGKILL."""
    events = tmp_path / "events"
    supervisor = Supervisor(tmp_path, FAST, poll_s=0.02)
    first = supervisor.spawn("w", [sys.executable, "-c", STAND_IN, "w", str(events)],
                             lambda _: {**os.environ, "DELAY": "1"}, restart=Restart.ALWAYS)
    wait_until(lambda: lines(events) == ["w up"], "the child to start")
    first.kill()
    wait_until(lambda: lines(events) == ["w up", "w up"], "the monitor to restart it")
    restarted = supervisor.proc("w")
    supervisor.stop(grace=30)
    assert restarted.returncode == 0 and lines(events)[-1] == "w stopped"


def test_each_child_has_a_process_group_of_its_own(tmp_path: Path) -> None:
    """A Ctrl-C at the terminal reaches `up` alone: it stops the children in order."""
    with Supervisor(tmp_path) as supervisor:
        child = supervisor.spawn("c", [sys.executable, "-c", "import time; time.sleep(60)"])
        assert os.getpgid(child.pid) == child.pid != os.getpgid(0)


SUPERVISE = """import sys, time
from pathlib import Path
from services.supervisor import Backoff, Restart, Supervisor
supervisor = Supervisor(Path(sys.argv[1]), Backoff(first_s=0.05), poll_s=0.02)
first = supervisor.spawn("first", ["sleep", "60"])
again = supervisor.spawn("again", ["sleep", "60"], restart=Restart.ALWAYS)
again.kill()
while supervisor.restarts()["again"] == 0:
    time.sleep(0.02)
print(first.pid, supervisor.proc("again").pid, flush=True)
time.sleep(60)
"""


def test_children_die_with_a_supervisor_killed_by_sigkill(tmp_path: Path) -> None:
    """`kill -9` of `up` left the whole stack serving, re-parented to PID 1 (a new `up`
    found its port in use): spawned or restarted, each child dies with its supervisor."""
    supervisor = subprocess.Popen([sys.executable, "-c", SUPERVISE, str(tmp_path)],
                                  stdout=subprocess.PIPE, text=True,
                                  cwd=Path(__file__).parents[2])
    try:
        assert supervisor.stdout is not None
        pids = [int(pid) for pid in supervisor.stdout.readline().split()]
        assert len(pids) == 2 and not any(gone(pid) for pid in pids)
    finally:
        supervisor.kill()
        supervisor.wait()
    try:
        wait_until(lambda: all(gone(pid) for pid in pids), "the children to die", timeout=10)
    finally:
        for pid in pids:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


# --- servers that come back ---

def restarted_once(stack: Stack, name: str) -> Callable[[], bool]:
    return lambda: stack.restarts()[name] == 1


def test_killed_servers_come_back_on_their_port_with_their_password(tmp_path: Path) -> None:
    """A nats-server killed left the stack answering 503 for ever."""
    stack = Stack(StackConfig(port=free_port(), run_dir=tmp_path))
    stack.run_dir.mkdir(parents=True)
    try:
        urls = {"nats": stack._start_nats(), "valkey": stack._start_valkey()}
        for name, problem in (("nats", nats_problem), ("valkey", redis_problem)):
            killed = stack.child(name)
            killed.kill()
            wait_until(restarted_once(stack, name), f"{name} to restart")
            port = int(urls[name].rsplit(":", 1)[1])
            wait_for_port(port, stack.child(name), name)
            assert stack.child(name).pid != killed.pid
            assert problem(urls[name]) is None  # the same password
    finally:
        stack.stop(drain_s=5)


# --- `up`, end to end ---

class Stream(threading.Thread):
    """A streamed completion of `max_tokens` (ignoring EOS), on a thread: the text chunks
    received and how it ended (its finish reason, or the error that cut it)."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.chunks, self.ended = 0, ""

    def run(self) -> None:
        body = {"model": "smollm2-135m", "prompt": "Once upon a time", "stream": True,
                "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body,
                              timeout=300) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        self.chunks += 1
                        if '"finish_reason":"' in line.replace(" ", ""):
                            self.ended = line.split('"finish_reason"')[1].split('"')[1]
        except httpx.HTTPError as e:
            self.ended = f"error: {e!r}"
        self.ended = self.ended or "no finish"


class Output(threading.Thread):
    """A process's output lines as they come, on a thread."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        super().__init__(daemon=True)
        self.proc, self.lines = proc, list[str]()
        self.start()

    def run(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, prefix: str, timeout: float) -> str:
        wait_until(lambda: any(line.startswith(prefix) for line in self.lines)
                   or self.proc.poll() is not None, f"`up` to say {prefix!r}", timeout)
        found = [line for line in self.lines if line.startswith(prefix)]
        assert found, "\n".join(self.lines)
        return found[0]


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_up_drains_on_sigterm_and_stops_at_once_on_a_second(tmp_path: Path) -> None:
    """SIGTERM: `up` says what it drains, refuses new connections at once (they hung ~8 s,
    then were reset), a request under way completes and another streams on past 10 s (it
    was cut then); a second SIGTERM stops it now, leaving nothing behind."""
    from tests.services.test_failures import running

    port = free_port()
    up = subprocess.Popen([sys.executable, "-m", "distserve.cli", "up", "--port", str(port),
                           "--run-dir", str(tmp_path)], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    try:
        said = Output(up)
        said.wait_for("ready:", timeout=600)
        url = f"http://127.0.0.1:{port}"
        short, long = Stream(url, 64), Stream(url, 4000)
        short.start()
        long.start()
        wait_until(lambda: short.chunks and long.chunks, "both streams to begin", 120)
        up.send_signal(signal.SIGTERM)
        terminated = time.monotonic()
        assert said.wait_for("stopping:", timeout=30) == (
            "stopping: draining 2 requests in flight (up to 120 s); Ctrl-C again to stop now")
        wait_until(lambda: refused(port), "new connections to be refused", 30)
        short.join(timeout=300)
        assert (short.ended, short.chunks) == ("length", 64), said.lines
        time.sleep(max(0.0, terminated + 12 - time.monotonic()))
        streamed = long.chunks
        time.sleep(1)
        assert long.chunks > streamed and up.poll() is None  # still draining, past 10 s
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=30) == 0
        long.join(timeout=30)
        assert long.ended != "length"  # cut: not waited for
        wait_until(lambda: running(tmp_path) == [], "no process of the stack left", 10)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
