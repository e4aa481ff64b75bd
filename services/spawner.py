"""The launcher's side of the planner's deployments. Under `distserve up --planner` the
launcher, not the planner, starts the workers the planner asks for (ds.launcher.start), so
they are the launcher's children: a planner that crashes or is killed takes none of them
down (a child dies with the thread that spawned it: services.supervisor), and they stop
with the stack, in its order. The planner also asks which of them have exited and stops
those that crashed as they started (services.planner.deployer.LauncherWorkers).

Only workers go this way, of the kinds the planner deploys, in the environment `up` gave
the planner, in the shape `up` fixed for their role where it fixed one; only those started
so can be asked about or stopped. One worker takes at most the planner's device budget, and
all it started that still run (draining ones too) at most four budgets: a plan holds one,
and a switch starts the new workers before the old ones drain."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

from nats.aio.client import Client
from nats.aio.msg import Msg
from pydantic import ValidationError

from services.planner.budget import Shape
from services.planner.deployer import WorkerStarter, ranks_of
from shared import subjects
from shared.bus import connect, parse
from shared.messages import StartedWorker, StartWorker, Workers

log = logging.getLogger(__name__)


class Spawner:
    """Answers the planner's requests on NATS from a thread of its own, which lives until
    `join`: the workers it starts die with it (so the launcher stops them first)."""

    def __init__(self, starter: WorkerStarter, nats_url: str, budget: int) -> None:
        self.starter, self.nats_url, self.budget = starter, nats_url, budget
        self.most = 4 * budget  # ranks of the workers it started that run
        self._lock = threading.Lock()  # a start against `close`
        self._closed = False
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="spawner", daemon=True)

    def start(self, timeout: float = 30.0) -> None:
        """Run it; return once it listens (RuntimeError: it could not)."""
        self._thread.start()
        if not self._ready.wait(timeout) or self._failed is not None:
            why = self._failed or f"no NATS connection within {timeout:g} s"
            raise RuntimeError(f"the launcher cannot take the planner's deployments: {why}")

    def close(self) -> None:
        """Start no more workers (the stack stops); a start under way ends first."""
        with self._lock:
            self._closed = True

    def join(self, timeout: float = 10.0) -> None:
        """Stop answering and end its thread (after the workers it started have stopped)."""
        self.close()
        if not self._thread.is_alive():
            return
        if self._loop is not None and self._stopping is not None:
            with contextlib.suppress(RuntimeError):  # its loop closed meanwhile
                self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as e:  # said by `start`, or logged once it listened
            self._failed = e
            if self._ready.is_set():
                log.exception("the launcher stopped taking the planner's deployments")
            self._ready.set()

    async def _serve(self) -> None:
        self._loop, self._stopping = asyncio.get_running_loop(), asyncio.Event()
        nc: Client = await connect(self.nats_url, "launcher")
        try:
            await nc.subscribe(subjects.LAUNCHER_START, cb=self._on_start)
            await nc.subscribe(subjects.LAUNCHER_EXITED, cb=self._on_exited)
            await nc.subscribe(subjects.LAUNCHER_STARTING, cb=self._on_starting)
            await nc.subscribe(subjects.LAUNCHER_STOP, cb=self._on_stop)
            await nc.flush()
            self._ready.set()
            await self._stopping.wait()
        finally:
            await nc.close()

    async def _on_start(self, msg: Msg) -> None:
        try:
            asked = parse(msg, StartWorker)
        except ValidationError as e:
            await msg.respond(StartedWorker(error=f"not a StartWorker: {e}").model_dump_json()
                              .encode())
            return
        await msg.respond(self.start_worker(asked).model_dump_json().encode())

    def start_worker(self, asked: StartWorker) -> StartedWorker:
        """Start the worker `asked` for, or say why not."""
        with self._lock:
            if self._closed:
                return StartedWorker(error="the stack is stopping")
            shape = Shape(asked.tp, asked.pp) if asked.tp and asked.pp else None
            ranks = ranks_of(self.starter.env(asked.kind, shape))
            if ranks > self.budget:
                return StartedWorker(error=f"{ranks} ranks: more than the planner's budget "
                                           f"of {self.budget} devices")
            if self.starter.running_ranks() + ranks > self.most:
                return StartedWorker(error=f"the workers it started run {self.most} ranks "
                                           f"at most (four device budgets)")
            try:
                return StartedWorker(instance=self.starter.start(asked.kind, shape))
            except OSError as e:
                return StartedWorker(error=f"cannot start it: {e}")

    async def _on_exited(self, msg: Msg) -> None:
        exited = self.starter.exited(self._asked(msg))
        await msg.respond(Workers(instances=exited).model_dump_json().encode())

    async def _on_starting(self, msg: Msg) -> None:
        starting = self.starter.starting()
        await msg.respond(Workers(instances=starting).model_dump_json().encode())

    async def _on_stop(self, msg: Msg) -> None:
        stopped = await asyncio.to_thread(self.starter.stop, self._asked(msg))
        await msg.respond(Workers(instances=stopped).model_dump_json().encode())

    @staticmethod
    def _asked(msg: Msg) -> list[str]:
        try:
            return parse(msg, Workers).instances
        except ValidationError:
            return []
