"""The workload profiler: watches every finished request (the gateway's events on NATS),
keeps sliding windows, and on a significant shift asks the planner for a new plan with a
summary of recent history. Its current view is kept in Redis for `distserve plan --live`."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import asdict

from nats.aio.msg import Msg
from pydantic_settings import BaseSettings, SettingsConfigDict
from redis.exceptions import RedisError

from services.planner.calibration import Calibration, Calibrator, replan_reason
from services.planner.profiles import (
    Profile,
    ProfileError,
    planner_profile,
    prefill_profile_or_none,
    with_prefill_of,
)
from services.process import ControlService
from services.profiler.detector import (
    DetectorConfig,
    RequestEvent,
    Shift,
    WindowStats,
    WorkloadMonitor,
)
from shared import subjects
from shared.bus import parse, publish
from shared.host import cpu_description
from shared.messages import ReplanRequest, RequestDone, WorkloadSummary
from shared.state import InstanceInfo

log = logging.getLogger(__name__)


class ProfilerSettings(BaseSettings):
    """DS_NATS_URL, DS_REDIS_URL and DS_PROFILER_* variables."""

    model_config = SettingsConfigDict(env_prefix="DS_")

    nats_url: str = "nats://127.0.0.1:4222"
    redis_url: str = "redis://127.0.0.1:6379"
    profiler_window: int = 60  # requests per window
    profiler_alpha: float = 1e-3  # significance of the tests
    profiler_min_ks: float = 0.3  # smallest length change (KS statistic) that counts
    profiler_min_rate_ratio: float = 2.0  # smallest rate change (either way) that counts
    profiler_cooldown_s: float = 30.0  # no new shift this soon after the last one
    profiler_check_every: int = 5
    # calibration: the planner's profile (the same DS_ variables the planner reads), the steps
    # it is calibrated over, and how far it may move before the planner replans
    planner_profile: str = ""
    planner_prefill_profile: str = ""  # prices the prefill workers' steps (their own dtype)
    threads: int = 1
    profiler_calibration_window: int = 2000  # steps per phase at most
    profiler_calibration_window_s: float = 120.0  # of the last this many seconds
    profiler_calibrate_every_s: float = 1.0  # fitted again at most this often
    profiler_recalibrate_ratio: float = 1.2  # (no sooner than the cooldown after a replan)

    def detector(self) -> DetectorConfig:
        return DetectorConfig(self.profiler_window, self.profiler_alpha, self.profiler_min_ks,
                              self.profiler_min_rate_ratio, self.profiler_cooldown_s,
                              self.profiler_check_every)


def summary(events: list[RequestEvent], stats: WindowStats) -> WorkloadSummary:
    return WorkloadSummary(rate_rps=stats.rate_rps, arrival_cv=stats.arrival_cv,
                           prompt_tokens=[e.prompt_tokens for e in events],
                           output_tokens=[e.output_tokens for e in events],
                           cached_tokens=[e.cached_tokens for e in events])


class ProfilerService(ControlService):
    name, subject = "profiler", subjects.REQUEST_EVENTS

    def __init__(self, settings: ProfilerSettings) -> None:
        super().__init__(settings.nats_url, settings.redis_url)
        self.settings = settings
        self.monitor = WorkloadMonitor(settings.detector())
        self.shifts: list[dict[str, object]] = []
        self.seen = 0
        self.calibrator: Calibrator | None = None
        self.profile: Profile | None = None
        self.prefill_profile: Profile | None = None  # the prefill workers' (with_prefill_of)
        self.unpriced: set[int] = set()  # tps the profile lacks, as logged
        try:
            self.profile = planner_profile(settings.planner_profile, settings.threads,
                                           cpu_description())
        except (ProfileError, OSError) as e:  # shift detection goes on without it
            log.warning("no latency profile to calibrate (%s): step times are not watched", e)
        if self.profile is not None:
            # the prefill workers' steps priced in their own dtype, as the planner prices
            # them (both fall back to the profile alike)
            prefiller = prefill_profile_or_none(settings.planner_prefill_profile, self.profile)
            if prefiller is not None:
                self.prefill_profile = with_prefill_of(self.profile, prefiller)
            tp = self.profile.tps[0]
            self.calibrator = Calibrator(
                self.profile.latency(tp, 1), settings.profiler_calibration_window,
                settings.profiler_calibration_window_s,
                also=(self.prefill_profile.latency(tp, 1),) if self.prefill_profile else ())
        self.calibration = Calibration()  # as last saved
        self.clock = time.monotonic  # of saved_at, fitted_at and replanned_at
        self.saved_at = self.fitted_at = -math.inf
        self.planned_on = Calibration()  # as when the last replan was asked for
        self.replanned_at = -math.inf

    async def serve(self, stop: asyncio.Event) -> None:
        await self.nc.subscribe(subjects.HEARTBEATS, cb=self._on_heartbeat)
        log.info("profiler watching %s (window %d) and the workers' step times", self.subject,
                 self.settings.profiler_window)
        await stop.wait()

    async def _on_heartbeat(self, msg: Msg) -> None:
        """The workers' latest step timings calibrate the planner's latency model; once it
        has moved far enough from what the last plan was made on, the planner plans again."""
        info = parse(msg, InstanceInfo)
        calibrator = self.calibrator
        if calibrator is None or self.profile is None:
            return
        if info.tp not in self.profile.tps:  # nothing to compare its steps with
            # (nor to say when it ran them: what its machine's other instances ran beside
            # it is not known)
            calibrator.timeline.add(info.instance_id, info.machine, [])
            calibrator.timeline.heard(info.instance_id, info.heartbeat_at, -1)
            if info.tp not in self.unpriced:
                self.unpriced.add(info.tp)
                log.warning("the profile has no tp %d: the steps of workers of tp %d are not "
                            "watched", info.tp, info.tp)
            return
        # a pipeline's workers report no step shapes (a step of theirs spans micro-batches):
        # the steps seen are of one stage of `tp` ranks; a prefill worker's priced in its
        # own dtype, so each phase's correction is the stack's over the right profile
        priced = self.prefill_profile if info.role == "prefill" and self.prefill_profile \
            else self.profile
        observed = calibrator.observe(info.instance_id, info.recent_steps,
                                      priced.latency(info.tp, 1), info.machine,
                                      info.heartbeat_at, info.steps, info.busy_since)
        # fitted at most once a second (every worker heartbeats twice a second; a fit takes
        # 4-20 ms), and saved when it moved (no Redis write for every heartbeat that moves
        # the levels a little) or every 10 s
        if observed and self.clock() - self.fitted_at >= self.settings.profiler_calibrate_every_s:
            self.fitted_at = self.clock()
            found = calibrator.calibration()
            if found.differs(self.calibration, 1.02, self.profile.contention) or \
                    self.clock() - self.saved_at >= 10:
                try:
                    await self.redis.set(subjects.CALIBRATION_KEY, found.model_dump_json())
                except (RedisError, OSError) as e:  # the next heartbeat tries again
                    log.warning("cannot save the calibration to Redis: %s", e)
                    return
                self.calibration, self.saved_at = found, self.clock()
        # on every heartbeat: a replan the cooldown held back goes once it is over
        reason = replan_reason(self.calibration, self.planned_on,
                               self.settings.profiler_recalibrate_ratio, calibrator.min_steps,
                               self.profile.contention)
        if reason is not None and self.monitor.reference and \
                self.clock() - self.replanned_at >= self.settings.profiler_cooldown_s:
            self.planned_on, self.replanned_at = self.calibration, self.clock()
            log.info("%s; asking for a new plan", reason)
            await publish(self.nc, subjects.REPLAN, ReplanRequest(reasons=[reason]))

    async def on_message(self, msg: Msg) -> None:
        done = parse(msg, RequestDone)
        if done.outcome not in ("stop", "length"):
            return  # failed or cancelled: its output length says nothing of the workload
        self.seen += 1
        event = RequestEvent(done.arrival_ts, done.prompt_tokens, done.output_tokens,
                             done.cached_tokens)  # (the planner takes all but one at most)
        shift = self.monitor.observe(event, time.time())
        if shift is not None:
            await self._replan(shift)
        await self._save_view()

    async def _replan(self, shift: Shift) -> None:
        events = self.monitor.reference  # the window that flagged the shift
        self.planned_on = self.calibration  # the planner reads the latest calibration
        self.replanned_at = self.clock()
        log.info("workload shift: %s", "; ".join(shift.reasons))
        self.shifts.append({"at": time.time(), "reasons": list(shift.reasons),
                            "before": asdict(shift.reference), "after": asdict(shift.recent)})
        await publish(self.nc, subjects.REPLAN, ReplanRequest(
            reasons=list(shift.reasons), workload=summary(events, shift.recent)))

    async def _save_view(self) -> None:
        recent = list(self.monitor.recent)
        view = {"updated_at": time.time(), "requests_seen": self.seen,
                "window": self.settings.profiler_window,
                "recent": asdict(WindowStats.of(recent)) if len(recent) > 1 else None,
                "reference": asdict(WindowStats.of(self.monitor.reference))
                if self.monitor.reference else None,
                "shifts": self.shifts[-10:], "calibration": self.calibration.model_dump()}
        await self.redis.set(subjects.PROFILER_KEY, json.dumps(view))
