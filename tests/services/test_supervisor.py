"""The supervisor: its restart policy as pure functions, and real children that crash, leave
on purpose or unasked, keep crashing or ignore SIGTERM. How children stop with it and how a
stack shuts down: test_shutdown.py."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from redis import Redis

import services.supervisor
from services.launcher import Stack, StackConfig, StartError
from services.supervisor import (
    DRAINED,
    Backoff,
    Restart,
    Supervisor,
    describe_exit,
    free_port,
    incarnation,
    log_tail,
    port_problem,
    restart_delay,
    wait_for_port,
)

pytestmark = pytest.mark.timeout(120)
FAST = Backoff(first_s=0.05, max_s=0.4, stable_s=60.0)
# appends its ID to the file named by its argument (once it runs), then sleeps
RECORD_AND_SLEEP = ("import os, sys, time\n"
                    "with open(sys.argv[1], 'a') as f: f.write(os.environ['ID'] + '\\n')\n"
                    "time.sleep(60)")


def wait_until(condition: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


# --- the policy ---

def test_a_clean_exit_is_restarted_only_where_any_exit_is() -> None:
    """A server or a service never exits on its own while healthy (ALWAYS: a clean exit is
    someone else's SIGTERM); a worker SIGTERMed where a planner runs leaves with code 0
    (ON_CRASH); one asked to leave by a Drain message (DRAINED) stays down under every
    policy. Code 3 from a child that does not drain (uvicorn's failed start) is a crash."""
    assert [policy.wants(0) for policy in Restart] == [False, False, True]
    assert [policy.wants(DRAINED, drains=True) for policy in Restart] == [False, False, False]
    assert [policy.wants(DRAINED) for policy in Restart] == [False, True, True]
    assert [policy.wants(1) for policy in Restart] == [False, True, True]
    assert [policy.wants(-signal.SIGKILL) for policy in Restart] == [False, True, True]
    assert (Restart.of(True), Restart.of(False)) == (Restart.ON_CRASH, Restart.NEVER)


def test_restarts_back_off_doubling_up_to_the_cap() -> None:
    policy, delays, previous = Backoff(), [], None
    for _ in range(7):
        previous = restart_delay(0.5, previous, policy)
        delays.append(previous)
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


def test_a_child_that_stayed_up_starts_again_from_the_first_delay() -> None:
    policy = Backoff()
    assert restart_delay(59.9, 16.0, policy) == 30.0
    assert restart_delay(60.0, 16.0, policy) == 1.0


def test_exits_are_described_by_code_or_signal_name() -> None:
    assert describe_exit(1) == "with code 1"
    assert describe_exit(-signal.SIGKILL) == "by SIGKILL"
    assert describe_exit(-200) == "by signal 200"


def test_each_incarnation_has_a_new_id_without_dots() -> None:
    assert [incarnation("decode-0", n) for n in range(3)] == \
        ["decode-0", "decode-0-r1", "decode-0-r2"]


# --- real children ---

def test_a_killed_child_comes_back_with_its_next_incarnations_env(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="services.supervisor")
    ids = tmp_path / "ids"
    with Supervisor(tmp_path, FAST, poll_s=0.05) as supervisor:
        first = supervisor.spawn("w", [sys.executable, "-c", RECORD_AND_SLEEP, str(ids)],
                                 lambda n: {**os.environ, "ID": incarnation("w", n)},
                                 restart=True)
        wait_until(lambda: lines(ids) == ["w"], "the first incarnation to run")
        os.kill(first.pid, signal.SIGKILL)
        wait_until(lambda: lines(ids) == ["w", "w-r1"], "the restarted child to run")
        second = supervisor.proc("w")
        assert second.pid != first.pid and second.poll() is None
        assert first.returncode == -signal.SIGKILL
        assert supervisor.restarts() == {"w": 1}
    assert second.poll() is not None  # stopped with the supervisor
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.getMessage().startswith("w exited by SIGKILL; restarting in 0.1 s "
                                           "(restart 1); log: ")
    log = (tmp_path / "w.log").read_text()  # one log, appended across restarts
    assert "--- supervisor: started at " in log and "--- supervisor: restart 1 at " in log


def test_a_child_that_exits_0_stays_down_where_only_crashes_restart(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="services.supervisor")
    with Supervisor(tmp_path, FAST, poll_s=0.05) as supervisor:
        supervisor.spawn("drained", [sys.executable, "-c", "pass"], restart=Restart.ON_CRASH)
        wait_until(lambda: supervisor.children[0].done, "the supervisor to see the exit")
        assert supervisor.proc("drained").returncode == 0
        assert supervisor.restarts() == {"drained": 0}
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "drained exited with code 0; not restarted" in caplog.records[0].getMessage()


def test_a_child_drained_on_request_stays_down_where_any_exit_restarts(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A worker drained by a Drain message was asked to leave: coming back would undo the
    drain (and load a model to serve nothing)."""
    caplog.set_level(logging.INFO, logger="services.supervisor")
    with Supervisor(tmp_path, FAST, poll_s=0.05) as supervisor:
        supervisor.spawn("w", [sys.executable, "-c", f"raise SystemExit({DRAINED})"],
                         restart=Restart.ALWAYS, drains=True)
        wait_until(lambda: supervisor.children[0].done, "the supervisor to see the exit")
        time.sleep(0.3)  # three restart delays
        assert supervisor.restarts() == {"w": 0}
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert caplog.records[0].getMessage().startswith(
        "w exited with code 3 (drained on request); not restarted")


def test_a_worker_asked_to_leave_that_then_hangs_stays_down(tmp_path: Path) -> None:
    """Drained, then frozen (or failed) before its orderly exit: killed as hung, it is not
    brought back, which would undo the drain (the planner counts on it gone)."""
    leaving = SHOW_ALIVE.replace("asyncio.run(main())", (
        "from services.liveness import mark_leaving\n"
        "mark_leaving(os.environ['DS_ALIVE_FILE'])\n"
        "asyncio.run(main())"))
    with Supervisor(tmp_path, FAST, poll_s=0.05) as supervisor:
        child = supervisor.spawn("w", [sys.executable, "-c", leaving, str(tmp_path / "i")],
                                 lambda n: {**os.environ, "ID": incarnation("w", n)},
                                 restart=Restart.ALWAYS, hang_s=1.0, drains=True)
        wait_until((tmp_path / "w.alive").exists, "the child to show it is alive")
        child.send_signal(signal.SIGSTOP)
        assert child.wait(timeout=30) == -signal.SIGKILL
        wait_until(lambda: supervisor.children[0].done, "the supervisor to see the exit")
        time.sleep(0.3)
        assert supervisor.restarts() == {"w": 0}


def test_a_child_stopped_from_outside_comes_back_where_any_exit_restarts(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A worker SIGTERMed by someone else drains and exits 0: the stack would serve without
    it for ever (it did: 503s while `up` ran on)."""
    caplog.set_level(logging.INFO, logger="services.supervisor")
    ids = tmp_path / "ids"
    with Supervisor(tmp_path, FAST, poll_s=0.05) as supervisor:
        drains = "import signal, sys\nsignal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
        first = supervisor.spawn("w", [sys.executable, "-c", drains + RECORD_AND_SLEEP, str(ids)],
                                 lambda n: {**os.environ, "ID": incarnation("w", n)},
                                 restart=Restart.ALWAYS)
        wait_until(lambda: lines(ids) == ["w"], "the first incarnation to run")
        first.terminate()
        wait_until(lambda: lines(ids) == ["w", "w-r1"], "the restarted child to run")
        assert first.returncode == 0 and supervisor.restarts() == {"w": 1}
    assert any(r.getMessage().startswith("w exited with code 0; restarting in 0.1 s")
               for r in caplog.records)


# shows it is alive as a worker does (services.process.show_alive), every 0.1 s, after
# recording its ID; with a second argument, only for that many seconds, then stops showing
# it in order (forget_alive) and stays up silent
SHOW_ALIVE = ("import asyncio, os, sys, time\n"
              "from services.liveness import forget_alive, show_alive\n"
              "with open(sys.argv[1], 'a') as f: f.write(os.environ['ID'] + '\\n')\n"
              "async def main():\n"
              "    alive = asyncio.create_task(show_alive(os.environ['DS_ALIVE_FILE'], 0.1))\n"
              "    await asyncio.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 60)\n"
              "    alive.cancel()\n"
              "    forget_alive(os.environ['DS_ALIVE_FILE'])\n"
              "    await asyncio.sleep(60)\n"
              "asyncio.run(main())\n")


def test_a_child_frozen_past_its_hang_timeout_is_killed_and_restarted(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """SIGSTOP stops a process without ending it: nothing but its silence tells."""
    caplog.set_level(logging.INFO, logger="services.supervisor")
    ids = tmp_path / "ids"
    with Supervisor(tmp_path, FAST, poll_s=0.05) as supervisor:
        first = supervisor.spawn("w", [sys.executable, "-c", SHOW_ALIVE, str(ids)],
                                 lambda n: {**os.environ, "ID": incarnation("w", n)},
                                 restart=Restart.ALWAYS, hang_s=2.0)
        wait_until((tmp_path / "w.alive").exists, "the child to show it is alive")
        time.sleep(3.0)  # alive for longer than the timeout: not killed
        assert first.poll() is None
        first.send_signal(signal.SIGSTOP)
        wait_until(lambda: lines(ids) == ["w", "w-r1"], "the frozen child to be replaced")
        assert first.wait(timeout=10) == -signal.SIGKILL
        assert supervisor.restarts() == {"w": 1}
    assert any(r.getMessage().startswith("w has not shown it is alive for ") and
               r.getMessage().endswith(" s (stopped, or hung): killing it")
               for r in caplog.records)


def test_a_child_frozen_as_it_is_stopped_is_killed_without_waiting_out_the_drain(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`up` stops a worker by waiting as long as it drains (120 s); a SIGSTOPped one never
    exits, and shows no life: it is killed once it has been silent STOPPING_HANG_S. One that
    ignores the SIGTERM but shows life is waited for, up to the grace. (Both ignore SIGTERM,
    as a worker handles it: Python's default for it ends even a stopped process.)"""
    monkeypatch.setattr(services.supervisor, "STOPPING_HANG_S", 3.0)
    caplog.set_level(logging.INFO, logger="services.supervisor")
    deaf = "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + SHOW_ALIVE
    with Supervisor(tmp_path, FAST, poll_s=0.05) as supervisor:
        frozen = supervisor.spawn("frozen", [sys.executable, "-c", deaf, str(tmp_path / "a")],
                                  lambda n: {**os.environ, "ID": "frozen"}, hang_s=60.0)
        busy = supervisor.spawn("busy", [sys.executable, "-c", deaf, str(tmp_path / "b")],
                                lambda n: {**os.environ, "ID": "busy"}, hang_s=60.0)
        for name in ("frozen", "busy"):
            wait_until((tmp_path / f"{name}.alive").exists, f"{name} to show it is alive")
        frozen.send_signal(signal.SIGSTOP)
        wait_until(lambda: Path(f"/proc/{frozen.pid}/stat").read_text().rsplit(")", 1)[1]
                   .split()[0] == "T", "the child to be stopped")
        started = time.monotonic()
        supervisor.stop(["frozen"], grace=600.0)
        frozen_took = time.monotonic() - started
        started = time.monotonic()
        supervisor.stop(["busy"], grace=6.0)
        busy_took = time.monotonic() - started
    assert frozen.returncode == busy.returncode == -signal.SIGKILL
    assert frozen_took < 60.0  # not the grace's 600 s, nor the hang timeout's 60 s
    assert busy_took >= 6.0
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("frozen has shown no life for ") and
               m.endswith(" s since it was asked to stop (stopped, or hung): killing it")
               for m in said), said
    assert "busy outlived 6 s after SIGTERM; killing it" in said
    assert not any(m.startswith("busy has shown no life") for m in said)


def test_a_child_that_has_not_shown_life_yet_or_no_longer_is_not_taken_for_hung(
        tmp_path: Path) -> None:
    """Starting (loading a model) or stopping (its heartbeats ended), a worker touches no
    file: only a file left untouched counts."""
    with Supervisor(tmp_path, FAST, poll_s=0.05) as supervisor:
        silent = supervisor.spawn("silent", [sys.executable, "-c", RECORD_AND_SLEEP,
                                             str(tmp_path / "a")],
                                  lambda n: {**os.environ, "ID": "silent"}, hang_s=1.0)
        ending = supervisor.spawn("ending", [sys.executable, "-c", SHOW_ALIVE,
                                             str(tmp_path / "b"), "0.5"],
                                  lambda n: {**os.environ, "ID": "ending"}, hang_s=2.0)
        wait_until((tmp_path / "ending.alive").exists, "the child to show it is alive")
        wait_until(lambda: not (tmp_path / "ending.alive").exists(), "it to remove its file")
        time.sleep(3.0)
        assert silent.poll() is None and ending.poll() is None


def test_a_child_with_a_backoff_of_its_own_is_restarted_by_it(tmp_path: Path) -> None:
    """nats-server and valkey-server come back within SERVER_BACKOFF's 4 s however often they
    died, not the workers' 30 s."""
    ids = tmp_path / "ids"
    own = Backoff(first_s=0.05, max_s=0.05)
    with Supervisor(tmp_path, Backoff(first_s=30.0, max_s=30.0), poll_s=0.05) as supervisor:
        supervisor.spawn("server", [sys.executable, "-c", RECORD_AND_SLEEP, str(ids)],
                         lambda n: {**os.environ, "ID": incarnation("server", n)},
                         restart=Restart.ALWAYS, backoff=own)
        def ran(n: int) -> Callable[[], bool]:
            return lambda: len(lines(ids)) == n

        for n in range(1, 4):
            wait_until(ran(n), f"incarnation {n} to run")
            supervisor.proc("server").kill()
        wait_until(ran(4), "the third restart", timeout=10)
    assert services.supervisor.SERVER_BACKOFF.max_s <= 5.0


def test_a_child_is_shown_alive_only_while_its_main_loop_turns(tmp_path: Path) -> None:
    """A worker's heartbeats beat on a thread of their own: they show it alive only while its
    main loop ticks, so a loop held for good is a hang too; the file is left for the
    supervisor to judge when the showing ends by an error."""
    from services.liveness import show_alive

    turns = iter([True, False, False, False, False, False])

    async def main() -> None:
        path = tmp_path / "x.alive"
        task = asyncio.create_task(show_alive(str(path), 0.05, lambda: next(turns, False)))
        await asyncio.sleep(0.02)
        assert path.exists()
        touched = path.stat().st_mtime_ns
        await asyncio.sleep(0.3)
        assert path.stat().st_mtime_ns == touched  # the loop stopped turning: untouched
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert path.exists()  # not removed but in order (forget_alive)

    asyncio.run(main())


def test_the_supervisor_held_up_itself_takes_no_child_for_hung(tmp_path: Path) -> None:
    """The whole tree frozen (a paused container): on waking, the monitor saw no touch for
    as long as it slept, through no child's fault."""
    with Supervisor(tmp_path, FAST, poll_s=0.05) as supervisor:
        child = supervisor.spawn("w", [sys.executable, "-c", SHOW_ALIVE, str(tmp_path / "i")],
                                 lambda n: {**os.environ, "ID": "w"}, hang_s=1.0)
        wait_until((tmp_path / "w.alive").exists, "the child to show it is alive")
        time.sleep(0.3)
        with supervisor._lock:  # the monitor is held 3 s, and the child with it
            child.send_signal(signal.SIGSTOP)
            time.sleep(3.0)
            child.send_signal(signal.SIGCONT)
        time.sleep(0.5)
        assert child.poll() is None and supervisor.restarts() == {"w": 0}


def test_a_child_without_restart_stays_down_after_a_crash(tmp_path: Path) -> None:
    with Supervisor(tmp_path, FAST, poll_s=0.05) as supervisor:
        supervisor.spawn("fixture", [sys.executable, "-c", "raise SystemExit(4)"])
        wait_until(lambda: supervisor.children[0].done, "the supervisor to see the exit")
        assert supervisor.proc("fixture").returncode == 4
        assert supervisor.restarts() == {"fixture": 0}


def test_a_crash_loop_backs_off_longer_each_time(tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="services.supervisor")
    with Supervisor(tmp_path, FAST, poll_s=0.02) as supervisor:
        supervisor.spawn("bad", [sys.executable, "-c", "raise SystemExit(1)"], restart=True)
        wait_until(lambda: supervisor.restarts()["bad"] >= 5, "five restarts")
    delays = [r.args[1] for r in caplog.records  # type: ignore[index]
              if r.levelno == logging.WARNING][:5]
    assert delays == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.4])
    assert (tmp_path / "bad.log").read_text().count("--- supervisor: restart") >= 5


def test_children_that_exit_once_a_stop_has_begun_are_stopped_not_restarted(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A Ctrl-C reaches `up`'s children as it reaches `up`: their exits, before `stop` has
    marked them, are the stop's, not crashes to restart (nor is one whose restart was due)."""
    caplog.set_level(logging.INFO, logger="services.supervisor")
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    with Supervisor(tmp_path, Backoff(first_s=30.0), poll_s=0.02) as supervisor:
        crashed = supervisor.spawn("crashed", sleep, restart=True)
        crashed.kill()
        wait_until(lambda: supervisor.children[0].due is not None, "the restart to be due")
        ready = tmp_path / "ready"  # a SIGINT before Python's own handler is set exits 1
        worker = supervisor.spawn("worker", [sys.executable, "-c", (
            "import sys, time; open(sys.argv[1], 'w').close(); time.sleep(60)"), str(ready)],
            restart=True)
        wait_until(ready.exists, "the worker to be up")
        supervisor.begin_stop()
        os.kill(worker.pid, signal.SIGINT)
        wait_until(lambda: all(c.done for c in supervisor.children), "both to stay down")
        assert supervisor.restarts() == {"crashed": 0, "worker": 0}
    said = [r.getMessage() for r in caplog.records]
    assert said[0].startswith("crashed exited by SIGKILL; restarting in 30.0 s")
    assert sorted(said[1:]) == ["crashed is not restarted: stopping",
                                "worker exited by SIGINT; stopping, not restarted"]


def test_stop_kills_a_child_that_ignores_sigterm_after_the_grace(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    stubborn = ("import signal, sys, time\n"
                "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "open(sys.argv[1], 'w').close()\n"
                "time.sleep(60)")
    supervisor = Supervisor(tmp_path, FAST, poll_s=0.05)
    proc = supervisor.spawn("stubborn", [sys.executable, "-c", stubborn, str(ready)],
                            restart=True)
    polite = supervisor.spawn("polite", [sys.executable, "-c", "import time; time.sleep(60)"],
                              restart=True)
    wait_until(ready.exists, "the child to ignore SIGTERM")
    started = time.monotonic()
    supervisor.stop(grace=0.5)
    assert time.monotonic() - started < 30
    assert proc.returncode == -signal.SIGKILL and polite.returncode == -signal.SIGTERM
    assert supervisor.children == []


def test_stop_some_children_leaves_the_others_running(tmp_path: Path) -> None:
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    with Supervisor(tmp_path, FAST, poll_s=0.05) as supervisor:
        a, b = supervisor.spawn("a", sleep, restart=True), supervisor.spawn("b", sleep)
        supervisor.stop(["a"])
        assert a.returncode == -signal.SIGTERM and b.poll() is None
        assert [c.name for c in supervisor.children] == ["b"]
        assert supervisor.restarts() == {"b": 0}  # a stopped child is not restarted
    assert b.poll() is not None


def test_each_worker_gets_its_own_gpu_while_there_are_enough() -> None:
    from services.devices import assign_devices, gpu_count

    assert assign_devices([1, 1, 1], 4) == ["cuda:0", "cuda:1", "cuda:2"]
    assert assign_devices([1, 1, 1], 2) == ["cuda:0", "cuda:1", "cuda:0"]
    assert assign_devices([2, 1, 1], 4) == ["cuda:0", "cuda:2", "cuda:3"]  # tp 2: GPUs 0, 1
    assert assign_devices([1, 1], 0) == ["", ""]
    assert gpu_count({"DS_DEVICE": "cpu"}) == 0  # the run chose the device itself


def test_torch_is_asked_for_gpus_only_where_a_gpu_driver_is_loaded(tmp_path: Path) -> None:
    from services.devices import gpu_driver_loaded

    assert not gpu_driver_loaded(tmp_path)
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "nvidiactl").touch()  # the control node alone: no GPU
    assert not gpu_driver_loaded(tmp_path)
    (tmp_path / "dev" / "nvidia0").touch()
    assert gpu_driver_loaded(tmp_path)
    (tmp_path / "dev" / "nvidia0").unlink()
    (tmp_path / "proc" / "driver" / "nvidia" / "gpus").mkdir(parents=True)
    assert gpu_driver_loaded(tmp_path)


# --- ports ---

def test_a_port_picked_for_one_server_is_not_picked_again_for_another(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The kernel may hand out a port again once its picker closed it (CI saw valkey take the
    port picked for the gateway): the launcher's picks for nats and valkey skip the
    gateway's, the kernel offering it first each time."""
    gateway = free_port()
    offers: list[int] = []

    def kernel() -> int:  # the gateway's port first, then the kernel's own picks
        offers.append(gateway if len(offers) % 2 == 0 else real())
        return offers[-1]

    real = services.supervisor._kernel_port
    monkeypatch.setattr(services.supervisor, "_kernel_port", kernel)
    stack = Stack(StackConfig(port=gateway, run_dir=tmp_path))
    stack.run_dir.mkdir(parents=True)
    try:
        ports = [int(url.rsplit(":", 1)[1]) for url in (stack._start_nats(),
                                                       stack._start_valkey())]
    finally:
        stack.stop(drain_s=5)
    assert offers.count(gateway) == 2 and gateway not in ports


def test_a_server_whose_port_another_took_starts_on_another(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Between a port's pick and the server's bind another process may take it: the server
    fails to bind, and is started again on another port; the other process listening
    there is not taken for it."""
    stack = Stack(StackConfig(port=free_port(), run_dir=tmp_path))
    stack.run_dir.mkdir(parents=True)
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        taken = other.getsockname()[1]
        offers: list[int] = []

        def kernel() -> int:  # the port another process took first, then the real picks
            offers.append(taken if not offers else real())
            return offers[-1]

        real = services.supervisor._kernel_port
        monkeypatch.setattr(services.supervisor, "_kernel_port", kernel)
        try:
            url = stack._start_valkey()
            assert Redis.from_url(url, socket_timeout=5).ping() is True
        finally:
            stack.stop(drain_s=5)
    assert offers[0] == taken and int(url.rsplit(":", 1)[1]) == offers[1] != taken
    assert "Address already in use" in (stack.run_dir / "valkey.log").read_text()


def test_waiting_for_a_server_is_not_fooled_by_another_on_its_port() -> None:
    with socket.socket() as other, subprocess.Popen(["sleep", "30"]) as sleeper:
        other.bind(("127.0.0.1", 0))
        other.listen()
        try:
            with pytest.raises(TimeoutError, match="did not listen on port"):
                wait_for_port(other.getsockname()[1], sleeper, "sleeper", timeout=1.0)
        finally:
            sleeper.kill()


def test_a_port_is_picked_below_the_ephemeral_ones() -> None:
    """Outgoing connections take their ports from the ephemeral range (and bind(0) hands
    them out): a server's port is picked below it, where the kernel says where it is."""
    below = services.supervisor._ephemeral_from()
    low = services.supervisor.PORTS_FROM if below > services.supervisor.PORTS_FROM + 1000 \
        else 1  # no room below them: the kernel's picks
    assert all(low <= free_port() < (below if low > 1 else 65536) for _ in range(20))


def test_a_port_someone_listens_on_is_in_use_until_they_close_it() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert port_problem(port) == "in use (another server listens there)"
    assert port_problem(port) is None
    assert port_problem(70000) == port_problem(0) == "not a TCP port (1-65535)"


def test_a_stack_whose_gateway_port_is_taken_says_so_and_starts_nothing(
        tmp_path: Path) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        stack = Stack(StackConfig(port=port, run_dir=tmp_path))
        with pytest.raises(StartError, match=f"cannot listen on port {port}: in use"):
            stack.start()
        assert stack.children == []
        up = subprocess.run([sys.executable, "-m", "distserve.cli", "up", "--port", str(port),
                             "--run-dir", str(tmp_path)], capture_output=True, text=True,
                            timeout=120)
    assert up.returncode == 2 and f"--port {port}: in use" in up.stderr, up.stderr
    assert list(tmp_path.iterdir()) == []  # no run directory: nothing was started


def test_a_logs_tail_leaves_out_the_supervisors_notes_and_blank_lines(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    log.write_text("--- supervisor: started at 1 ---\nold\n\n--- supervisor: restarted at 2 ---\n"
                   "a\n\nb\nc\n")
    assert log_tail(log, lines=3) == "a\nb\nc"
    assert log_tail(log) == "old\na\nb\nc"
    assert log_tail(tmp_path / "absent.log") == ""


def test_a_restart_that_fails_is_tried_again_and_the_monitor_lives_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A child whose environment cannot be made for its first restart: the monitor logs it
    and tries again (its thread ending would kill, by PR_SET_PDEATHSIG, every child it
    restarted, and no monitor would start again), and the restart after that runs."""
    record = tmp_path / "ids"
    asked = []

    def env(restarts: int) -> dict[str, str]:
        asked.append(restarts)
        if asked.count(1) == 1 and restarts == 1:
            raise ValueError("no environment this time")
        return {**os.environ, "ID": str(restarts)}

    with Supervisor(tmp_path / "logs", FAST) as supervisor, caplog.at_level(logging.ERROR):
        proc = supervisor.spawn("w", [sys.executable, "-c", RECORD_AND_SLEEP, str(record)],
                                env, restart=Restart.ALWAYS)
        wait_until(lambda: lines(record) == ["0"], "the first incarnation")
        proc.kill()
        wait_until(lambda: lines(record) == ["0", "1"], "the restart after the failed one")
        assert "restarting w failed; trying again" in caplog.text
