"""Deployers apply a plan's worker counts and shapes. The local one starts prefill, decode
and colocated (plain or chunked-prefill) worker processes on this host with the plan's tp
and pp, and drains the ones no longer needed (beyond a kind's count, or of another shape);
scaling up completes (the new workers heartbeat, so the gateway dispatches to them) before
anything is drained. A change of mode or shape is one such step: the new workers start, then
the old ones drain, finishing what they hold. Under `distserve up` the launcher starts them
at the planner's request, as its own children, so they outlive a planner that crashes
(LauncherWorkers); a planner run on its own starts them as its children (OwnWorkers)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence, Set
from pathlib import Path
from typing import Protocol

import nats.errors
from nats.aio.client import Client
from pydantic import BaseModel

from services.devices import assign_devices, gpu_count
from services.liveness import hang_timeout
from services.planner.budget import Shape
from services.planner.modes import KINDS, Kind, role_of
from services.planner.profiles import Profile
from services.supervisor import Child, Restart, Supervisor, incarnation
from shared import subjects
from shared.bus import publish
from shared.engine.config import ModelConfig
from shared.engine.parallel.layout import check_tp
from shared.messages import Drain, StartedWorker, StartWorker, Workers
from shared.state import InstanceInfo, Registry, Role

log = logging.getLogger(__name__)
ROLES: tuple[Role, ...] = ("prefill", "decode", "colocated")


def role_env(env: Mapping[str, str], role: Role) -> dict[str, str]:
    """A new `role` worker's weight format, dtype, tensor-parallel ranks and pipeline
    stages: its role's (`DS_DECODE_WEIGHTS`, `DS_PREFILL_DTYPE`, `DS_PREFILL_TP`, ...: what
    `distserve up` gave the role's workers) or every worker's (`DS_WEIGHTS`, `DS_DTYPE`,
    `DS_TP`, `DS_PP`); unset, the worker's own defaults."""
    own = {}
    for setting in ("WEIGHTS", "DTYPE", "TP", "PP"):
        value = env.get(f"DS_{role.upper()}_{setting}") or env.get(f"DS_{setting}")
        if value:
            own[f"DS_{setting}"] = value
    return own


def fixed_shapes(env: Mapping[str, str]) -> dict[Role, Shape]:
    """The roles whose workers' tp and pp `distserve up` fixed (`role_env` gives them), with
    those shapes; the planner chooses the other roles' shapes."""
    fixed = {}
    for role in ROLES:
        own = role_env(env, role)
        if "DS_TP" in own or "DS_PP" in own:
            fixed[role] = Shape(int(own.get("DS_TP", 1)), int(own.get("DS_PP", 1)))
    return fixed


def unpriced_dtypes(env: Mapping[str, str], profile: Profile, on_gpu: bool,
                    prefill_profile: Profile | None = None) -> dict[Role, str]:
    """The roles whose workers compute in another dtype than the profile that prices them
    was measured in (`prefill_profile`, where given, prices the prefill role), with that
    dtype ("auto": float32 on a CPU; on a GPU the worker's choice, not known here). The live
    calibration moves each phase to what the workers measure, so a bfloat16 prefill
    instance priced on a float32 profile also sets the price of the prefills of float32
    colocated replicas."""
    out: dict[Role, str] = {}
    for role in ROLES:
        priced = prefill_profile if role == "prefill" and prefill_profile else profile
        measured = priced.dtype or ("float32" if not on_gpu else "")
        dtype = role_env(env, role).get("DS_DTYPE", "auto")
        if dtype == "auto" and not on_gpu:
            dtype = "float32"
        if measured and dtype != "auto" and dtype != measured:
            out[role] = dtype
    return out


def priced_shapes(fixed: Mapping[Role, Shape], profile: Profile) -> dict[Role, Shape]:
    """The shapes `up` fixed, as the planner prices them: one of a tp the profile lacks as
    the profile's smallest tp, with a warning (those workers then hold more devices, and
    run at another speed, than the plans say)."""
    priced = {}
    for role, shape in fixed.items():
        if shape.tp in profile.tps:
            priced[role] = shape
            continue
        priced[role] = Shape(profile.tps[0], shape.pp)
        log.warning("%s workers run tp %d but the profile has tp %s only: planning them as "
                    "tp %d; profile the tp with `distserve profile --tp`", role, shape.tp,
                    "/".join(map(str, profile.tps)), profile.tps[0])
    return priced


def runnable_tps(profile: Profile, model: ModelConfig, on_gpu: bool) -> Profile:
    """`profile` with only the tps workers of `model` can run: one rank on a GPU (parallel
    instances there need NCCL, not built), and on the CPU the tps that split its heads and
    MLP columns, and its quantization blocks (checked as quantized, so that any role's
    weight format runs them); its measured pipelines likewise, and only those of no more
    stages than the model has layers. Every tp, with a warning, where none is left."""
    def runs(tp: int) -> bool:
        if tp == 1:
            return True
        if on_gpu:
            return False
        try:
            check_tp(model, tp, quantized=True)
        except ValueError:
            return False
        return True

    by_tp = {tp: co for tp, co in profile.by_tp.items() if runs(tp)}
    pipelines = {(tp, pp): co for (tp, pp), co in profile.pipelines.items()
                 if runs(tp) and not on_gpu and pp <= model.num_layers}
    if not by_tp:
        log.warning("the workers can run none of the profile's tps (%s) here: planning on "
                    "them all", profile.tps)
        by_tp = profile.by_tp
    return dataclasses.replace(profile, by_tp=by_tp, pipelines=pipelines)


def ranks_of(env: Mapping[str, str]) -> int:
    """The processes (and, on a GPU host, the GPUs) a worker of this environment runs."""
    return int(env.get("DS_TP") or 1) * int(env.get("DS_PP") or 1)


def kind_of(info: InstanceInfo) -> Kind:
    return "chunked" if info.role == "colocated" and info.chunked else info.role


def live_shapes(live: Mapping[Kind, list[InstanceInfo]]) -> dict[Kind, Shape]:
    """The shape most live workers of each kind have (kinds with none left out)."""
    shapes = {}
    for kind, workers in live.items():
        if workers:
            tally = Counter((w.tp, w.pp) for w in workers)
            shapes[kind] = Shape(*max(sorted(tally), key=lambda s: tally[s]))
    return shapes


async def live_workers(registry: Registry, drained: Set[str] = frozenset()
                       ) -> dict[Kind, list[InstanceInfo]]:
    """The live workers that take requests (none draining, none in `drained`: told to
    drain, their heartbeat may not say so yet), by kind."""
    live: dict[Kind, list[InstanceInfo]] = {kind: [] for kind in KINDS}
    for role in ROLES:
        for info in await registry.instances(role):
            if not info.draining and info.instance_id not in drained:
                live[kind_of(info)].append(info)
    return live


class DeployError(RuntimeError):
    pass


class Deployer(Protocol):
    drained: set[str]  # the workers it told to drain

    async def apply(self, counts: Mapping[Kind, int],
                    shapes: Mapping[Kind, Shape] | None = None) -> dict[str, list[str]]: ...

    def stop(self) -> None: ...


def to_drain(live: list[InstanceInfo], want: int) -> list[InstanceInfo]:
    """The least-loaded instances beyond `want` (they finish soonest)."""
    extra = max(0, len(live) - want)
    by_load = sorted(live, key=lambda i: (i.running + i.queue_len, i.instance_id))
    return by_load[:extra]


def changes(live: Mapping[Kind, list[InstanceInfo]], counts: Mapping[Kind, int],
            shapes: Mapping[Kind, Shape]) -> tuple[dict[Kind, int], list[InstanceInfo]]:
    """What applying a plan takes: the workers of each kind to start, and those to drain:
    every one of another shape than `shapes` gives its kind (a kind it lacks keeps any),
    and the least loaded beyond the kind's count."""
    start: dict[Kind, int] = {}
    drain: list[InstanceInfo] = []
    for kind in KINDS:
        shape, want = shapes.get(kind), counts.get(kind, 0)
        fit = [i for i in live.get(kind, []) if shape is None or (i.tp, i.pp) == (shape.tp,
                                                                                 shape.pp)]
        drain += [i for i in live.get(kind, []) if i not in fit] + to_drain(fit, want)
        start[kind] = max(0, want - len(fit))
    return start, drain


class LogOnlyDeployer:
    """Records plans without acting (e.g. under docker-compose, where an orchestrator
    scales the containers)."""

    def __init__(self) -> None:
        self.drained: set[str] = set()

    async def apply(self, counts: Mapping[Kind, int],
                    shapes: Mapping[Kind, Shape] | None = None) -> dict[str, list[str]]:
        log.info("plan (not applied): %s, shapes %s", dict(counts),
                 {kind: str(shape) for kind, shape in (shapes or {}).items()})
        return {"started": [], "drained": []}

    def stop(self) -> None:
        pass


def worker_env(base: Mapping[str, str], kind: Kind, shape: Shape | None) -> dict[str, str]:
    """A new `kind` worker's environment over `base` (the planner's: what `up` gave every
    worker and each role): its role's weights, dtype, tp and pp (`role_env`), or the plan's
    `shape`; a colocated one prefills in chunks or not as its kind says."""
    env = {**base, **role_env(base, role_of(kind))}
    for unset in ("DS_TP", "DS_PP"):  # `up` leaves them empty where it set none
        if not env.get(unset):
            env.pop(unset, None)
    if shape is not None:
        env.update(DS_TP=str(shape.tp), DS_PP=str(shape.pp))
    if role_of(kind) == "colocated":
        env["DS_CHUNKED_PREFILL"] = str(kind == "chunked").lower()
    return env


class WorkerStarter:
    """Starts the planner's workers as children of `supervisor` with `worker_env` over
    `base` (a role whose shape `up` fixed keeps it, whatever shape is asked), on a GPU host
    on the next GPUs in turn after the `ranks` of the workers started before (the planner's
    own starter knows none: its workers may share a GPU with the launcher's). One that
    crashes comes back under a new instance id; one drained exits DRAINED and stays down.
    Only the workers it started can be asked about or stopped."""

    def __init__(self, supervisor: Supervisor, base: Mapping[str, str], gpus: int = 0,
                 ranks: Sequence[int] = ()) -> None:
        self.supervisor, self.base, self.gpus = supervisor, dict(base), gpus
        self.fixed = fixed_shapes(self.base)  # roles whose tp and pp `up` set
        self.ranks = list(ranks)
        self.started: dict[str, int] = {}  # the workers it started, with their ranks

    def env(self, kind: Kind, shape: Shape | None) -> dict[str, str]:
        """A new `kind` worker's environment, `shape` dropped where `up` fixed its role's."""
        return worker_env(self.base, kind, None if role_of(kind) in self.fixed else shape)

    def start(self, kind: Kind, shape: Shape | None) -> str:
        instance = f"{kind}-{uuid.uuid4().hex[:6]}"
        env = self.env(kind, shape)
        self.ranks.append(ranks_of(env))
        device = assign_devices(self.ranks, self.gpus)[-1]
        if device:
            env["DS_DEVICE"] = device
        self.supervisor.spawn(instance, [sys.executable, "-m", f"services.{role_of(kind)}"],
                              lambda restarts: {**env,
                                                "DS_INSTANCE_ID": incarnation(instance, restarts)},
                              restart=Restart.ON_CRASH, hang_s=hang_timeout(env), drains=True)
        self.started[instance] = self.ranks[-1]
        log.info("started %s (%s)%s", instance, shape or "tp and pp as `up` set them",
                 f" on {device}" if device else "")
        return instance

    def _children(self) -> dict[str, Child]:
        """The workers it started that the supervisor still has, by name (one snapshot)."""
        return {c.name: c for c in self.supervisor.children if c.name in self.started}

    def exited(self, instances: Iterable[str]) -> list[str]:
        """Those of `instances` it started that have exited since (crashed: restarted or
        not, or stopped)."""
        now = self._children()
        return [i for i in instances if i in self.started and (
            i not in now or now[i].restarts > 0 or now[i].proc.poll() is not None)]

    def starting(self) -> list[str]:
        """The workers it started that run as first started (never crashed): those a
        planner restarted while they were starting has to wait for."""
        return [name for name, child in self._children().items()
                if child.restarts == 0 and child.proc.poll() is None]

    def stop(self, instances: Iterable[str], grace: float = 15.0) -> list[str]:
        """Stop those of `instances` it started (SIGTERM: a worker drains); the ones stopped."""
        mine = [i for i in instances if i in self.started]
        self.supervisor.stop(mine, grace=grace)
        return mine

    def running_ranks(self) -> int:
        """The ranks (processes, devices) of the workers it started that run now, draining
        ones and restarted ones included."""
        return sum(self.started[name] for name, child in self._children().items()
                   if child.proc.poll() is None)


class WorkerHands(Protocol):
    """What starts the planner's workers: its own supervisor (`OwnWorkers`), or the
    launcher of `distserve up` (`LauncherWorkers`)."""

    async def start(self, kind: Kind, shape: Shape | None) -> str: ...

    async def exited(self, instances: list[str]) -> list[str]: ...

    async def starting(self) -> list[str]: ...

    async def stop(self, instances: list[str]) -> None: ...

    def close(self) -> None: ...


class OwnWorkers:
    """Workers started as children of the planner (a planner run on its own): they die
    with it."""

    def __init__(self, run_dir: str | None) -> None:
        self.starter = WorkerStarter(Supervisor(Path(run_dir or ".")), os.environ,
                                     gpu_count(os.environ))

    async def start(self, kind: Kind, shape: Shape | None) -> str:
        return self.starter.start(kind, shape)

    async def exited(self, instances: list[str]) -> list[str]:
        return self.starter.exited(instances)

    async def starting(self) -> list[str]:
        return self.starter.starting()

    async def stop(self, instances: list[str]) -> None:
        await asyncio.to_thread(self.starter.stop, instances)

    def close(self) -> None:
        """Stop (drain) the workers it started."""
        self.starter.supervisor.stop(grace=15.0)


class LauncherWorkers:
    """Workers the launcher of `distserve up` starts at the planner's request, as its own
    children (services.spawner): they outlive a planner that crashes or is killed, and stop
    with the stack."""

    def __init__(self, nc: Client, timeout_s: float = 30.0) -> None:
        self.nc, self.timeout_s = nc, timeout_s

    async def start(self, kind: Kind, shape: Shape | None) -> str:
        asked = StartWorker(kind=kind, tp=shape.tp if shape else 0, pp=shape.pp if shape else 0)
        reply = StartedWorker.model_validate_json(await self._ask(subjects.LAUNCHER_START,
                                                                  asked))
        if reply.error:
            raise DeployError(f"the launcher started no {kind} worker: {reply.error}")
        return reply.instance

    async def exited(self, instances: list[str]) -> list[str]:
        reply = await self._ask(subjects.LAUNCHER_EXITED, Workers(instances=instances))
        return Workers.model_validate_json(reply).instances

    async def starting(self) -> list[str]:
        reply = await self._ask(subjects.LAUNCHER_STARTING, Workers())
        return Workers.model_validate_json(reply).instances

    async def stop(self, instances: list[str]) -> None:
        await self._ask(subjects.LAUNCHER_STOP, Workers(instances=instances), 60.0)

    def close(self) -> None:
        pass  # the launcher stops them with the stack, in its order

    async def _ask(self, subject: str, message: BaseModel, timeout_s: float = 0.0) -> bytes:
        try:
            reply = await self.nc.request(subject, message.model_dump_json().encode(),
                                          timeout=timeout_s or self.timeout_s)
        except (nats.errors.Error, OSError) as e:
            raise DeployError(f"the launcher did not answer {subject}: "
                              f"{str(e) or type(e).__name__}") from None
        return reply.data


class LocalDeployer:
    """Starts workers on this host through its `hands` and drains the ones a plan no
    longer needs."""

    def __init__(self, nc: Client, registry: Registry, hands: WorkerHands,
                 health_timeout_s: float = 300.0, fixed: Set[Role] = frozenset()) -> None:
        self.nc, self.registry, self.hands = nc, registry, hands
        self.health_timeout_s = health_timeout_s
        self.drained: set[str] = set()
        self.fixed = fixed  # roles whose tp and pp `up` set (fixed_shapes): kept

    async def apply(self, counts: Mapping[Kind, int],
                    shapes: Mapping[Kind, Shape] | None = None) -> dict[str, list[str]]:
        """Start and drain workers until each kind has its count, in its shape (a role's
        shape `up` fixed stays: `shapes` cannot change it)."""
        shapes = {k: s for k, s in (shapes or {}).items() if role_of(k) not in self.fixed}
        await self._wait_for_starting()
        live = await live_workers(self.registry, self.drained)
        start, draining = changes(live, counts, shapes)
        started = [await self.hands.start(kind, shapes.get(kind)) for kind in KINDS
                   for _ in range(start[kind])]
        if started:
            await self._wait_healthy(started)
        drained = [i.instance_id for i in draining]
        for instance in drained:
            await publish(self.nc, subjects.drain(instance), Drain(reason=f"plan {counts}"))
            self.drained.add(instance)
        if started or drained:
            log.info("applied %s: started %s, draining %s", dict(counts), started, drained)
        return {"started": started, "drained": drained}

    async def _wait_for_starting(self) -> None:
        """Workers started and not heartbeating yet (a planner killed while they started
        left them; this one, restarted, never heard of them) count once they serve: wait
        for them, or they would be started twice."""
        starting = await self.hands.starting()
        if starting and (unheard := sorted(set(starting) - await self._heard())):
            log.info("waiting for %s, started before, to serve", unheard)
            await self._wait_healthy(unheard)

    async def _heard(self) -> set[str]:
        """The instances that heartbeat now."""
        return {i.instance_id for role in ROLES for i in await self.registry.instances(role)}

    async def _wait_healthy(self, instances: list[str]) -> None:
        """Until every new instance heartbeats; one that crashes while starting fails the
        deployment and is stopped (restarting it would only crash again)."""
        deadline = time.monotonic() + self.health_timeout_s
        while time.monotonic() < deadline:
            crashed = await self.hands.exited(instances)
            if crashed:
                await self.hands.stop(crashed)
                raise DeployError(f"{crashed} exited while starting; see their logs")
            if (await self._heard()).issuperset(instances):
                return
            await asyncio.sleep(0.5)
        raise DeployError(f"{instances} not healthy within {self.health_timeout_s:.0f}s")

    def stop(self) -> None:
        """The planner stops: so do the workers it started itself (not the launcher's)."""
        self.hands.close()
