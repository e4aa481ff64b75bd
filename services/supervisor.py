"""One way to run child processes: spawn them by name with their output in a log, restart
the ones that exit unasked, and stop them without leaving any behind. The launcher's stack,
the planner's local deployer and the test fixtures all run their processes through it.

Whether a child is restarted is the caller's choice per child (`Restart`): a server or a
service never exits on its own while healthy, so any exit the supervisor did not ask for
brings it back after a backoff; a worker asked to leave (a Drain message: the planner's or
an operator's) exits with `DRAINED`, which no policy restarts in a child spawned as one that
`drains` (only there: 3 is also uvicorn's code for a failed start), and one SIGTERMed from
outside exits 0, which only ALWAYS restarts.

A child spawned with a hang timeout is handed a file to touch (`DS_ALIVE_FILE`, every second
from a thread or loop that only lives while the process does: `show_alive`); once it has
touched it, a child that leaves it untouched for the timeout (stopped, or wedged with the
GIL or its loop held) is SIGKILLed, and its policy decides whether it comes back; being
stopped, it is SIGKILLed once it is STOPPING_HANG_S silent (if its timeout is not shorter),
not waited for to the end of its grace. A child that has not touched it yet (starting) or has
removed it (stopping in order) is left alone.

Each child runs in a process group of its own (a Ctrl-C at the terminal reaches the
supervisor, which stops the children in its order) and is SIGKILLed by the kernel when the
thread that spawned it exits (Linux: PR_SET_PDEATHSIG), so a supervisor killed with SIGKILL
leaves nothing serving. Restarts are spawned by the monitor thread, which lives while any
child does; spawn the others from a thread that lives as long as the supervisor (the main
thread, or an event loop's)."""

from __future__ import annotations

import contextlib
import ctypes
import enum
import errno
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import psutil

from services.liveness import alive_file, leaving_mark, watched

log = logging.getLogger(__name__)

Env = Callable[[int], Mapping[str, str]]  # restarts so far -> that incarnation's environment
DRAINED = 3  # the exit code of a worker that left because it was asked to: it stays down
PAUSED_S = 2.0  # a monitor's poll this late means the supervisor itself was held up
# a child being stopped that leaves its alive file untouched this long (it touches it every
# second while it runs, draining included) is not draining: killed rather than waited for
STOPPING_HANG_S = 15.0


@dataclass(frozen=True)
class Backoff:
    """Delays between restarts: `first_s`, doubling up to `max_s`; a child that stayed up
    `stable_s` is back to `first_s` (its crash is news, not a loop)."""

    first_s: float = 1.0
    max_s: float = 30.0
    stable_s: float = 60.0


# nats-server and valkey-server start in milliseconds and every service waits on them: a
# server killed twice in a minute is not left down 30 s (the chaos trial's nats was)
SERVER_BACKOFF = Backoff(first_s=0.5, max_s=4.0)


class Restart(enum.Enum):
    """Which exits the supervisor did not ask for bring a child back."""

    NEVER = "never"
    ON_CRASH = "on crash"  # a code but 0 (or DRAINED, from a child that drains), or a signal
    ALWAYS = "always"  # any exit (but DRAINED's): a server or service never leaves on its own

    @classmethod
    def of(cls, restart: Restart | bool) -> Restart:
        """`restart` as a policy; True: ON_CRASH (the planner's deployer asks so)."""
        if isinstance(restart, Restart):
            return restart
        return cls.ON_CRASH if restart else cls.NEVER

    def wants(self, returncode: int, drains: bool = False) -> bool:
        """Whether a child that exited with `returncode`, unasked, is started again (one that
        `drains` and exited DRAINED: never)."""
        if drains and returncode == DRAINED:
            return False
        return self is Restart.ALWAYS or (self is Restart.ON_CRASH and returncode != 0)


def restart_delay(uptime_s: float, previous_s: float | None, backoff: Backoff) -> float:
    """How long to wait before restarting a child that exited after `uptime_s`."""
    if previous_s is None or uptime_s >= backoff.stable_s:
        return backoff.first_s
    return min(2 * previous_s, backoff.max_s)


def describe_exit(returncode: int, drains: bool = False) -> str:
    if drains and returncode == DRAINED:
        return f"with code {DRAINED} (drained on request)"
    if returncode >= 0:
        return f"with code {returncode}"
    try:
        return f"by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"by signal {-returncode}"


def incarnation(name: str, restarts: int) -> str:
    """`name` first, then `name-r1`, `name-r2`, ...: an id that is new after each restart
    (no dots: instance ids are NATS subject tokens)."""
    return name if restarts == 0 else f"{name}-r{restarts}"


PORTS_FROM = 10000  # the ports picked for servers: from here to the ephemeral ones
# picks of its own: a test's random.seed() would give parallel runs the same ports
PICKS = random.SystemRandom()
EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_from() -> int:
    """Where the kernel's ephemeral ports begin (0 if it does not say)."""
    try:
        return int(EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _kernel_port() -> int:
    """A port of 127.0.0.1 free now, below the ephemeral ones where the kernel can: those
    are what every outgoing connection takes its port from, and what another picker's
    bind(0) hands out, in the moment between this pick and the server's bind."""
    if (below := _ephemeral_from()) > PORTS_FROM + 1000:
        for _ in range(100):
            with socket.socket() as s, contextlib.suppress(OSError):
                s.bind(("127.0.0.1", port := PICKS.randrange(PORTS_FROM, below)))
                return port
    with socket.socket() as s:  # the kernel's own pick
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port(avoid: Collection[int] = ()) -> int:
    """A port of 127.0.0.1 free now, none of `avoid`: a port picked for another server but
    not yet bound may be handed out again."""
    while (port := _kernel_port()) in avoid:
        pass
    return port


def listen(port: int, host: str = "127.0.0.1") -> socket.socket:
    """A socket listening on `host`:`port`, bound as uvicorn binds; ValueError saying why
    there can be none (not a port, in use, or the system's reason)."""
    if not 0 < port < 65536:
        raise ValueError("not a TCP port (1-65535)")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)  # uvicorn's default backlog
    except OSError as e:
        sock.close()
        raise ValueError("in use (another server listens there)" if e.errno == errno.EADDRINUSE
                         else e.strerror or str(e)) from None
    return sock


def port_problem(port: int, host: str = "127.0.0.1") -> str | None:
    """Why a server could not listen on `host`:`port` now, None if it could."""
    try:
        listen(port, host).close()
    except ValueError as e:
        return str(e)
    return None


def listens(proc: subprocess.Popen[bytes], port: int) -> bool:
    """Whether `proc` itself listens on 127.0.0.1:`port`, not another process that took the
    port (where the system does not let its sockets be read: whether anything does)."""
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
        try:
            return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                       for c in psutil.Process(proc.pid).net_connections("tcp"))
        except psutil.AccessDenied:
            return True
        except psutil.Error:  # it exited
            return False
    return False


def wait_for_port(port: int, proc: subprocess.Popen[bytes], what: str,
                  timeout: float = 30.0) -> None:
    """Until `proc` listens on `port`; fail at once if it exits (another process that
    listens there is not it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited {describe_exit(proc.returncode)}")
        if listens(proc, port):
            return
        time.sleep(0.05)
    raise TimeoutError(f"{what} did not listen on port {port} within {timeout:.0f}s")


@dataclass(eq=False)
class Child:
    """A named child and its current incarnation (`proc` changes when it is restarted)."""

    name: str
    argv: list[str]
    env: Env | None  # None: this process's environment
    restart: Restart
    log: Path
    proc: subprocess.Popen[bytes]
    started: float  # monotonic, of the current incarnation
    restarts: int = 0
    delay_s: float | None = None  # the last backoff, None before the first crash
    due: float | None = None  # when a crashed child is restarted (monotonic)
    done: bool = False  # exited and stays down; the supervisor leaves it alone
    stopping: bool = False  # stop() has it; the monitor leaves it alone
    pass_fds: tuple[int, ...] = ()  # file descriptors each incarnation inherits
    hang_s: float | None = None  # killed once its alive file is this long untouched
    backoff: Backoff | None = None  # None: the supervisor's
    drains: bool = False  # a worker: its exit DRAINED means it was asked to leave
    touched: tuple[float, float] | None = None  # the file's mtime, and when it was first seen

    @property
    def alive(self) -> Path:
        """The file the child touches to show it is not hung (where `hang_s` is set)."""
        return alive_file(self.log)

    def silent_s(self, now: float) -> float | None:
        """How long the child has left its alive file untouched, as seen by the calls with
        `now` (a monotonic clock: the wall clock may jump) since `touched` was last cleared;
        None without a file (no hang timeout, not touched yet: starting, or removed:
        stopping in order)."""
        try:
            mtime = self.alive.stat().st_mtime if self.hang_s is not None else None
        except OSError:
            mtime = None
        if mtime is None:
            self.touched = None
            return None
        if self.touched is None or self.touched[0] != mtime:
            self.touched = (mtime, now)
        return now - self.touched[1]


def log_tail(path: Path, lines: int = 12) -> str:
    """The last `lines` lines `path` holds (the supervisor's notes and blank lines left out),
    for an error message."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    said = [line for line in text.splitlines()
            if line.strip() and not line.startswith("--- supervisor:")]
    return "\n".join(said[-lines:])


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def dying_with_spawner() -> Callable[[], None] | None:
    """A `preexec_fn` that has the child SIGKILLed when the thread spawning it exits (its
    supervisor killed included); None where there is no prctl (not Linux). libc is looked up
    here, before the fork: the child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def die_with_parent() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if os.getppid() != parent:  # the supervisor died before the line above
            os._exit(1)

    return die_with_parent


def launch(argv: list[str], env: Mapping[str, str] | None, log_path: Path,
           note: str, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
    """`argv` with stdout and stderr appended to `log_path` (the child keeps its own handle),
    inheriting `pass_fds`, in a process group of its own, dying with the calling thread."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as out:
        out.write(f"--- supervisor: {note} at {time.strftime('%Y-%m-%d %H:%M:%S')} ---\n"
                  .encode())
        out.flush()
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                env=None if env is None else dict(env), pass_fds=pass_fds,
                                process_group=0, preexec_fn=dying_with_spawner())


class Supervisor:
    """Children by name, each logged to `<log_dir>/<name>.log`. A daemon thread polls them
    every `poll_s` while any is alive, and restarts those whose policy asks for it."""

    def __init__(self, log_dir: Path, backoff: Backoff = Backoff(), poll_s: float = 0.25) -> None:
        self.log_dir, self.backoff, self.poll_s = log_dir, backoff, poll_s
        self._children: dict[str, Child] = {}
        self._lock = threading.Lock()  # the monitor and the caller both change children
        self._monitor: threading.Thread | None = None
        self._closing = False  # every child is about to be stopped: none is restarted
        self._now = False  # stop at once: kill what is left, wait for no drain

    def spawn(self, name: str, argv: list[str], env: Env | None = None,
              restart: Restart | bool = Restart.NEVER,
              pass_fds: tuple[int, ...] = (), hang_s: float | None = None,
              backoff: Backoff | None = None, drains: bool = False
              ) -> subprocess.Popen[bytes]:
        """Start `argv` as child `name` (`env(0)` its environment, inheriting `pass_fds`);
        an exit `restart` wants brings it back with `env(restarts)` and the same fds, after
        `backoff` (default: the supervisor's); one that `drains` (a worker) and exits
        DRAINED stays down. With `hang_s`, it is killed once it leaves its alive file
        untouched that long. The child dies with the calling thread (see the
        module's docstring)."""
        with self._lock:
            if name in self._children and not self._children[name].done:
                raise ValueError(f"a child named {name} is already running")
            path = self.log_dir / f"{name}.log"
            alive = None if hang_s is None else alive_file(path)
            proc = launch(argv, watched(None if env is None else env(0), alive), path,
                          "started", pass_fds)
            self._children[name] = Child(name, argv, env, Restart.of(restart), path, proc,
                                         time.monotonic(), pass_fds=pass_fds, hang_s=hang_s,
                                         backoff=backoff, drains=drains)
            if self._monitor is None:
                self._monitor = threading.Thread(target=self._watch, name="supervisor",
                                                 daemon=True)
                self._monitor.start()
        return proc

    @property
    def children(self) -> list[Child]:
        with self._lock:
            return list(self._children.values())

    def proc(self, name: str) -> subprocess.Popen[bytes]:
        """The current incarnation of child `name`."""
        with self._lock:
            return self._children[name].proc

    def restarts(self) -> dict[str, int]:
        with self._lock:
            return {c.name: c.restarts for c in self._children.values()}

    def begin_stop(self) -> None:
        """Every child is about to be stopped (a SIGTERM sent to the whole process group
        reaches the children too, before `stop` marks them): a child that exits from now on
        is stopped, not restarted. Safe in a signal handler (takes no lock)."""
        self._closing = True

    def end_restarts(self) -> None:
        """`begin_stop`, and return once no restart is under way: none starts after this
        (so the fds the children inherit may be closed)."""
        self._closing = True
        with self._lock:  # a restart happens under the lock, after reading _closing
            pass

    def stop_now(self) -> None:
        """Stop at once (a second Ctrl-C): what `stop` waits for is killed now, and later
        stops kill without waiting. Safe in a signal handler (takes no lock)."""
        self._closing = self._now = True

    def stop(self, names: Iterable[str] | None = None, grace: float = 10.0) -> None:
        """Stop the named children (default: all), the last started first: SIGTERM, then
        SIGKILL whatever outlives `grace` (at once after `stop_now`). They are forgotten and
        never restarted."""
        wanted = None if names is None else set(names)
        with self._lock:
            chosen = [c for c in reversed(self._children.values())
                      if wanted is None or c.name in wanted]
            for child in chosen:
                child.stopping = True
        for child in chosen:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGKILL if self._now else signal.SIGTERM)
        self._reap(chosen, grace)
        with self._lock:
            for child in chosen:
                if self._children.get(child.name) is child:
                    del self._children[child.name]

    def _reap(self, chosen: list[Child], grace: float) -> None:
        """Until every child in `chosen` has exited; SIGKILL those left after `grace` or
        once `stop_now` is called, and at once one with a hang timeout that shows no life
        for STOPPING_HANG_S (or its timeout, if shorter) from the stop on: a frozen worker
        drains nothing, and `up` would wait out its drain timeout (120 s) on it."""
        polled = time.monotonic()
        deadline = polled + grace
        for child in chosen:
            child.touched = None  # silent from now on counts (the monitor no longer looks)
        while left := [c for c in chosen if c.proc.poll() is None]:
            now = time.monotonic()
            if self._now or now >= deadline:
                break
            paused, polled = now - polled > PAUSED_S, now  # this thread held up: see _monitor
            for child in left:
                if child.hang_s is None:
                    continue
                if paused:
                    child.touched = None
                silent = child.silent_s(now)
                if silent is not None and silent > min(child.hang_s, STOPPING_HANG_S):
                    log.warning("%s has shown no life for %.0f s since it was asked to stop "
                                "(stopped, or hung): killing it", child.name, silent)
                    child.proc.kill()
                    child.touched = None
            time.sleep(0.05)
        for child in left:
            if self._now:
                log.warning("stopping now: killing %s", child.name)
            else:
                log.warning("%s outlived %.0f s after SIGTERM; killing it", child.name, grace)
            child.proc.kill()
            child.proc.wait()

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _watch(self) -> None:
        """Poll until no child is alive or due to restart (the next spawn starts a new
        monitor). Not before: a child this thread restarted dies when it exits."""
        polled = time.monotonic()
        while True:
            time.sleep(self.poll_s)
            with self._lock:
                now = time.monotonic()
                watched = [c for c in self._children.values() if not (c.done or c.stopping)]
                if now - polled > max(PAUSED_S, 4 * self.poll_s):
                    # this thread was stopped too (the whole tree frozen: a paused container
                    # or VM, heavy swapping): no child had its chance to show it is alive
                    for child in watched:
                        child.touched = None
                polled = now
                for child in watched:
                    try:
                        self._check(child, now)
                    except Exception:  # this thread's end would kill what it restarted
                        log.exception("restarting %s failed; trying again", child.name)
                if not any(not (c.done or c.stopping) or c.proc.poll() is None
                           for c in self._children.values()):
                    self._monitor = None
                    return

    def _check(self, child: Child, now: float) -> None:
        """Restart `child` if its backoff is over; else notice whether it exited."""
        if child.due is not None:
            if self._closing:
                child.done, child.due = True, None
                log.info("%s is not restarted: stopping", child.name)
            elif now >= child.due:
                self._restart(child, now)
            return
        code = child.proc.poll()
        if code is None:
            if child.hang_s is not None and not self._closing:
                self._kill_if_hung(child, now)
            return
        how = f"{child.name} exited {describe_exit(code, child.drains)}"
        if self._closing:
            child.done = True
            log.info("%s; stopping, not restarted", how)
            return
        if child.drains and code != DRAINED and child.hang_s is not None and \
                leaving_mark(child.alive).exists():
            child.done = True  # asked to leave, it ended otherwise (hung, failed): not back
            log.warning("%s while draining on request; not restarted; log: %s", how, child.log)
            return
        if not child.restart.wants(code, child.drains):
            child.done = True
            level = logging.INFO if code == 0 or (child.drains and code == DRAINED) \
                else logging.WARNING
            log.log(level, "%s; not restarted; log: %s", how, child.log)
            return
        delay = restart_delay(now - child.started, child.delay_s,
                              child.backoff or self.backoff)
        child.delay_s, child.due = delay, now + delay
        log.warning("%s; restarting in %.1f s (restart %d); log: %s", how, delay,
                    child.restarts + 1, child.log)

    def _kill_if_hung(self, child: Child, now: float) -> None:
        """SIGKILL `child` if its alive file has not changed for its `hang_s` (timed by this
        clock: the wall clock may jump)."""
        assert child.hang_s is not None
        if (silent := child.silent_s(now)) is not None and silent > child.hang_s:
            log.warning("%s has not shown it is alive for %.0f s (stopped, or hung): killing "
                        "it", child.name, silent)
            child.alive.unlink(missing_ok=True)
            child.touched = None
            with contextlib.suppress(ProcessLookupError):
                child.proc.kill()

    def _restart(self, child: Child, now: float) -> None:
        restarts = child.restarts + 1
        env = watched(None if child.env is None else child.env(restarts),
                      None if child.hang_s is None else child.alive)
        child.touched = None
        try:
            child.proc = launch(child.argv, env, child.log, f"restart {restarts}",
                                child.pass_fds)
        except OSError as e:
            backoff = child.backoff or self.backoff
            child.delay_s = min(2 * (child.delay_s or backoff.first_s), backoff.max_s)
            child.due = now + child.delay_s
            log.error("%s could not be restarted (%s); trying again in %.1f s", child.name, e,
                      child.delay_s)
            return
        child.restarts, child.started, child.due = restarts, now, None
