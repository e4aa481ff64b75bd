"""The planner service: on a replan request (from the profiler, `distserve plan --live
--replan`, or every DS_PLANNER_INTERVAL_S) it decides the plan for the recent workload
(services/planner/decide.py, pure), records the plan and its reason in Redis, and applies it
through a deployer. Requests that arrive while a plan is being made or applied are
coalesced: only the latest is acted on."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import Any, Literal

from nats.aio.msg import Msg
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from redis.exceptions import RedisError

from services.devices import gpu_count
from services.planner.budget import Shape
from services.planner.calibration import Calibration
from services.planner.decide import PlannerConfig, decide
from services.planner.deployer import (
    Deployer,
    LauncherWorkers,
    LocalDeployer,
    LogOnlyDeployer,
    OwnWorkers,
    WorkerHands,
    fixed_shapes,
    live_shapes,
    live_workers,
    priced_shapes,
    runnable_tps,
    unpriced_dtypes,
)
from services.planner.modes import MODES, SWITCH_MARGIN, Kind, Mode, parse_modes, serving_mode
from services.planner.profiles import (
    Profile,
    measured_elsewhere,
    planner_profile,
    prefill_profile_or_none,
)
from services.process import ControlService
from shared import subjects
from shared.aio import cancel_within
from shared.bus import parse
from shared.engine.config import served_name
from shared.engine.meta import read_config
from shared.host import cpu_description
from shared.messages import ReplanRequest, WorkloadSummary
from shared.metrics import SLO
from shared.state import Registry

log = logging.getLogger(__name__)


class PlannerSettings(BaseSettings):
    """DS_NATS_URL, DS_REDIS_URL, DS_RUN_DIR, DS_THREADS and DS_PLANNER_* variables."""

    model_config = SettingsConfigDict(env_prefix="DS_")

    nats_url: str = "nats://127.0.0.1:4222"
    redis_url: str = "redis://127.0.0.1:6379"
    run_dir: str | None = None
    threads: int = 1
    model: str = "smollm2-135m"  # what the workers serve (DS_MODEL)
    device: str = "auto"  # the workers' device (DS_DEVICE): "auto" takes a GPU where one is
    heartbeat_ttl_s: float = 2.0
    planner_profile: str = ""  # default: the shipped CPU profile for DS_THREADS
    # measured in the prefill workers' dtype (DS_PREFILL_DTYPE) where it is not the profile's:
    # prices the disaggregated mode's prefill instances (`distserve profile --dtype`)
    planner_prefill_profile: str = ""
    planner_ttft_s: float = 5.0
    planner_tpot_s: float = 0.2
    planner_attainment: float = 0.9
    planner_devices: int = 0  # device budget; 0 = the number of CPU cores
    # who starts the workers: the planner (local: they die with it), `distserve up`'s launcher
    # (launcher: they outlive the planner; `up` sets it), or nobody (none: plans are logged)
    planner_deployer: Literal["local", "launcher", "none"] = "local"
    planner_modes: str = ",".join(MODES)  # the modes it may deploy (all are weighed)
    planner_switch_margin: float = Field(default=SWITCH_MARGIN, ge=1.0)  # a new mode's gain
    planner_interval_s: float = 0.0  # also plan again this often (0: only when asked)
    restarts: int = 0  # how often the supervisor restarted this planner (DS_RESTARTS)
    planner_calibrate: bool = True  # plan on the profile as the workers' step times correct it
    # the workers' scheduler limits (the same DS_ variables the workers read)
    max_batch_tokens: int = 512
    max_running: int = 64

    @property
    def budget(self) -> int:
        return self.planner_devices or os.cpu_count() or 2

    def profile(self) -> Profile:
        here = cpu_description()
        profile = planner_profile(self.planner_profile, self.threads, here)
        if profile.model.name != served_name(self.model):
            log.warning("planning on a profile of %s while the workers serve %s: measure one "
                        "with `distserve profile --model %s` and name it in DS_PLANNER_PROFILE",
                        profile.model.name, served_name(self.model), self.model)
        elsewhere = measured_elsewhere(profile, here)
        if elsewhere:
            log.warning("%s: its step times may be far off here (the live calibration corrects "
                        "their level, not their shape); measure one with `distserve profile` "
                        "and name it in DS_PLANNER_PROFILE", elsewhere)
        return profile

    @field_validator("planner_modes")
    @classmethod
    def _known_modes(cls, value: str) -> str:
        return ",".join(parse_modes(value))

    @property
    def modes(self) -> tuple[Mode, ...]:
        return parse_modes(self.planner_modes)

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda") or (self.device == "auto" and gpu_count({}) > 0)

    def config(self) -> PlannerConfig:
        profile = self.runnable(self.profile())
        prefiller = prefill_profile_or_none(self.planner_prefill_profile, profile)
        if prefiller is not None:
            log.info("pricing disaggregated prefill instances on %s (%s)",
                     self.planner_prefill_profile, prefiller.dtype)
        for role, dtype in unpriced_dtypes(os.environ, profile, self.on_gpu,
                                           prefiller).items():
            fix = (f"name a profile measured in {dtype} (`distserve profile --dtype {dtype}`) "
                   "in DS_PLANNER_PREFILL_PROFILE" if role == "prefill" else
                   "one profile prices the other roles")
            log.warning("the %s workers compute in %s, their profile was measured in %s: "
                        "every kind's steps of a phase are priced alike (the live calibration "
                        "moves them to what the workers measure), so the modes weighed online "
                        "are priced as if all ran one dtype; %s", role, dtype,
                        (prefiller if role == "prefill" and prefiller else profile).dtype
                        or "float32", fix)
        return PlannerConfig(profile, SLO(self.planner_ttft_s, self.planner_tpot_s),
                             self.planner_attainment, self.budget, modes=self.modes,
                             switch_margin=self.planner_switch_margin,
                             batch_tokens=self.max_batch_tokens, max_running=self.max_running,
                             fixed=priced_shapes(fixed_shapes(os.environ), profile),
                             prefill_profile=prefiller)

    def runnable(self, profile: Profile) -> Profile:
        """`profile` less the tps the workers cannot run here (`runnable_tps`)."""
        return runnable_tps(profile, read_config(self.model), self.on_gpu)


class PlannerService(ControlService):
    name, subject = "planner", subjects.REPLAN

    def __init__(self, settings: PlannerSettings) -> None:
        super().__init__(settings.nats_url, settings.redis_url)
        self.settings = settings
        self.config = settings.config()
        self.latest: ReplanRequest | None = None
        self.last_workload: WorkloadSummary | None = None
        self.wake = asyncio.Event()
        self.deployer: Deployer
        self.registry: Registry
        self.applied_mode: Mode | None = None

    async def serve(self, stop: asyncio.Event) -> None:
        registry = self.registry = Registry(self.redis, self.settings.heartbeat_ttl_s)
        how = self.settings.planner_deployer
        hands: WorkerHands | None = (LauncherWorkers(self.nc) if how == "launcher" else
                                     OwnWorkers(self.settings.run_dir) if how == "local" else
                                     None)
        self.deployer = (LogOnlyDeployer() if hands is None else
                         LocalDeployer(self.nc, registry, hands, fixed=set(self.config.fixed)))
        log.info("planner ready: budget %d devices, SLO TTFT %.3gs TPOT %.3gs, %s deployer",
                 self.config.budget, self.config.slo.ttft_s, self.config.slo.tpot_s,
                 self.settings.planner_deployer)
        await self._resume_last_plan()
        tasks = [asyncio.create_task(self._plan_forever()), asyncio.create_task(stop.wait())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:  # no plan applied once the deployer stops (one that lost its cancel would)
            await cancel_within(tasks, who="planner")
            await asyncio.get_running_loop().run_in_executor(None, self.deployer.stop)

    async def _resume_last_plan(self) -> None:
        """A planner restarted (it crashed, or was killed) lost the workload it planned for,
        and, where it started its workers itself (not the launcher's), those workers, which
        die with it: plan again at once for the
        workload of the last plan in Redis, which starts what is missing (before, nothing was
        started until the profiler saw the workload shift, and a stack whose first workers
        the planner had drained served nothing meanwhile). Only a restarted one: a planner
        starting with its stack does not replay what a Redis kept from another stack."""
        if self.settings.restarts == 0:
            return
        try:
            text = await self.redis.get(subjects.PLAN_KEY)
        except (RedisError, OSError) as e:
            log.warning("cannot read the last plan from Redis (%s)", e)
            return
        if not text:
            return  # a new stack: the first plan waits for a workload
        try:
            stored = WorkloadSummary.model_validate(json.loads(text)["inputs"])
        except (ValueError, KeyError, TypeError) as e:
            log.warning("the last plan in Redis cannot be read (%s): waiting for a workload", e)
            return
        if self.latest is not None or self.last_workload is not None:
            return  # a replan request came meanwhile, with the workload as it is now
        log.info("restarted: planning again for the last plan's workload (%d requests at "
                 "%.2f req/s)", len(stored.prompt_tokens), stored.rate_rps)
        self.last_workload = stored
        self.latest = ReplanRequest(reasons=["the planner restarted"])
        self.wake.set()

    async def on_message(self, msg: Msg) -> None:
        self.latest = parse(msg, ReplanRequest)
        self.wake.set()

    async def _plan_forever(self) -> None:
        interval = self.settings.planner_interval_s or None
        while True:
            try:
                async with asyncio.timeout(interval):
                    await self.wake.wait()
            except TimeoutError:
                self.latest = self.latest or ReplanRequest(reasons=["timer"])
            self.wake.clear()
            request, self.latest = self.latest, None
            if request is not None:
                try:
                    await self.replan(request)
                except Exception:  # a failed plan must not stop the next one
                    log.exception("replanning failed")

    async def calibration(self) -> Calibration | None:
        """The latency model's correction as the profiler last measured it on the workers
        (None: plan on the profile as it is, also with DS_PLANNER_CALIBRATE=false)."""
        if not self.settings.planner_calibrate:
            return None
        try:
            text = await self.redis.get(subjects.CALIBRATION_KEY)
        except (RedisError, OSError) as e:
            log.warning("cannot read the calibration from Redis (%s): planning on the profile", e)
            return None
        return Calibration.model_validate_json(text) if text else None

    async def serving(self) -> tuple[Mode | None, dict[Kind, Shape]]:
        """The mode the live workers serve in (less those the deployer drained and whose
        heartbeats may not say so yet), and the shape most of each kind have; where Redis
        cannot tell (unreachable, or no mode has its workers live, as while one restarts),
        the mode last applied (and no shapes)."""
        try:
            live = await live_workers(self.registry, self.deployer.drained)
        except (RedisError, OSError) as e:
            log.warning("cannot read the live workers from Redis (%s)", e)
            return self.applied_mode, {}
        found = serving_mode({kind: len(workers) for kind, workers in live.items()})
        return (found, live_shapes(live)) if found else (self.applied_mode, {})

    async def replan(self, request: ReplanRequest) -> dict[str, Any]:
        started = time.monotonic()
        calibration, (current, shapes) = await self.calibration(), await self.serving()
        decision = await asyncio.get_running_loop().run_in_executor(
            None, decide, request, self.last_workload, self.config, time.time(), calibration,
            current, shapes)
        if decision is None:
            log.warning("replan requested (%s) before any workload was seen",
                        "; ".join(request.reasons))
            return {}
        self.last_workload = decision.workload
        record = {**decision.record, "search_s": time.monotonic() - started}
        scales = calibration or Calibration()
        log.info("plan: %s, predicted goodput %.2f req/s (%s); %s; live: %s; step times: "
                 "prefill %s, decode %s", decision.plan.layout,
                 decision.plan.goodput_rps, "; ".join(request.reasons),
                 ", ".join(f"{c.mode} {c.goodput_rps:.2f}" for c in decision.candidates),
                 current or "nothing", scales.describe("prefill"), scales.describe("decode"))
        await self._save(record)
        record["applied"] = await self.deployer.apply(decision.target, decision.plan.shapes)
        record["applied_at"] = time.time()
        self.applied_mode = decision.plan.mode
        await self._save(record)
        return record

    async def _save(self, record: dict[str, Any]) -> None:
        text = json.dumps(record)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(subjects.PLAN_KEY, text)
            if "applied_at" not in record:
                pipe.lpush(subjects.PLAN_HISTORY_KEY, text)
                pipe.ltrim(subjects.PLAN_HISTORY_KEY, 0, 19)
            await pipe.execute()
