"""The engine steps a stack's workers ran during a benchmark: each worker heartbeats its last
steps (`InstanceInfo.recent_steps`, every 0.5 s), and a recorder reads them from Redis while
the benchmark runs. They are the step times the stack itself took at each rate, beside
everything else it ran, which the online planner calibrates its latency model on
(services/planner/calibration.py); `bench compare --simulate` simulates each rate on them
too, which tells the simulator's errors from the profile's."""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import statistics
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import ValidationError
from redis import Redis
from redis.exceptions import RedisError

from services.planner.calibration import Calibration, Calibrator, predicted_s
from services.planner.latency import Contention, LatencyModel, Phase
from services.planner.profiles import Profile
from shared import subjects
from shared.state import InstanceInfo, StepSample

Steps = dict[str, list[StepSample]]  # instance -> its steps, in order


class StepLog:
    """Steps seen, each once, from the overlapping windows of each instance's last steps
    that its heartbeats carry (pure)."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}  # instance -> its newest step kept
        self._steps: Steps = {}

    def add(self, instance: str, samples: Iterable[StepSample]) -> int:
        """Keep the samples of `instance` newer than any kept before; how many were new."""
        last = self._last.get(instance, 0)
        new = sorted((s for s in samples if s.step > last), key=lambda s: s.step)
        if new:
            self._steps.setdefault(instance, []).extend(new)
            self._last[instance] = new[-1].step
        return len(new)

    def take(self) -> Steps:
        """The steps kept since the last take, which forgets them (not where each instance
        got to: a step is never kept twice)."""
        steps, self._steps = self._steps, {}
        return steps


def calibration_of(steps: Steps, latency: LatencyModel) -> Calibration:
    """What the online planner would make of `steps`: each phase's correction of `latency`
    that fits them best (its median ratio or per-step offset; 1.0 for a phase with fewer
    than the calibrator's minimum of steps)."""
    calibrator = Calibrator(latency, window=1 << 30)
    for instance, samples in steps.items():
        calibrator.observe(instance, samples)
    return calibrator.calibration()


def phase_of(step: StepSample) -> Phase:
    return "prefill" if step.prompts else "decode"


def neighbours(steps: Steps) -> list[tuple[str, StepSample, list[Phase]]]:
    """Each step that says when it ended, with the phases of the steps the host's other
    instances were running at its midpoint (an instance runs one step at a time)."""
    spans = {instance: sorted((s.ended - s.seconds, s.ended, phase_of(s))
                              for s in samples if s.ended > 0)
             for instance, samples in steps.items()}
    starts = {instance: [start for start, _, _ in found] for instance, found in spans.items()}
    out = []
    for instance, samples in steps.items():
        for s in samples:
            if s.ended <= 0:
                continue
            middle, beside = s.ended - s.seconds / 2, []
            for other, found in spans.items():
                if other == instance:
                    continue
                i = bisect.bisect_right(starts[other], middle) - 1
                if i >= 0 and found[i][1] >= middle:
                    beside.append(found[i][2])
            out.append((instance, s, beside))
    return out


@dataclasses.dataclass(frozen=True)
class Live:
    """A profile fitted to the steps a stack ran: each phase's correction from the steps
    that ran alone on the host (all of the phase's where too few did), and how much longer
    a step took beside a neighbour's step of each phase (the profile's own factor where too
    few did); `contention` None where the steps do not say when they ran."""

    calibration: Calibration
    contention: Contention | None
    profile: Profile

    def to_json(self) -> dict[str, Any]:
        return self.calibration.model_dump() | {
            "contention": dataclasses.asdict(self.contention) if self.contention else None}


def live_profile(steps: Steps, profile: Profile, min_steps: int = 10) -> Live:
    """`profile` as the steps in `steps` ran: what the online planner's calibration makes of
    them, taken on the steps that ran alone, and the contention measured on those that ran
    beside one other instance's step. Without the steps' end times: the calibration of all
    of them, which already holds whatever contention they met (the profile's dropped)."""
    latency = profile.latency(1, 1)
    timed = neighbours(steps)
    if not timed:
        found = calibration_of(steps, latency)
        return Live(found, None, found.apply(profile))
    alone: Steps = {}
    for instance, s, beside in timed:
        if not beside:
            alone.setdefault(instance, []).append(s)
    every, quiet = calibration_of(steps, latency), calibration_of(alone, latency)
    fields: dict[str, Any] = {}
    for phase in ("prefill", "decode"):
        pick = quiet if getattr(quiet, f"{phase}_steps") >= min_steps else every
        fields |= {name: getattr(pick, name) for name in Calibration.model_fields
                   if name.startswith(phase)}
    base = Calibration.model_validate(fields)
    calibrated = base.apply(profile)
    corrected = calibrated.latency(1, 1)
    factors = dataclasses.asdict(profile.contention)
    for phase in ("prefill", "decode"):
        for other in ("prefill", "decode"):
            pairs = [(s.seconds / predicted_s(corrected, s), _share(corrected, s))
                     for _, s, beside in timed if phase_of(s) == phase and beside == [other]]
            if len(pairs) >= min_steps:
                slower = statistics.median(r for r, _ in pairs)
                share = statistics.median(w for _, w in pairs)
                factors[f"{phase}_by_{other}"] = max(1.0, 1.0 + (slower - 1.0) / share)
    contention = Contention(**factors)
    return Live(base, contention, dataclasses.replace(calibrated, contention=contention))


def _share(latency: LatencyModel, s: StepSample) -> float:
    """The share of the step a neighbour slows (as the simulator prices it)."""
    return 1.0 if s.prompts else max(latency.reading_share(s.batch, s.context), 1e-3)


def steps_to_json(steps: Steps) -> dict[str, list[list[Any]]]:
    """Compact: [step, prompts, batch, context, seconds, ended] a step."""
    return {instance: [[s.step, s.prompts, s.batch, s.context, round(s.seconds, 6),
                        round(s.ended, 6)] for s in samples]
            for instance, samples in steps.items()}


def steps_from_json(data: dict[str, Sequence[Sequence[Any]]]) -> Steps:
    return {instance: [StepSample(step=row[0], prompts=row[1], batch=row[2], context=row[3],
                                  seconds=row[4], ended=row[5] if len(row) > 5 else 0.0)
                       for row in rows]
            for instance, rows in data.items()}


class StepRecorder:
    """Reads every live instance's heartbeat from Redis every `interval_s` (a heartbeat
    carries a worker's last 64 steps and comes every 0.5 s, so steps down to ~8 ms are all
    seen) into a StepLog, on a thread of its own, until closed."""

    def __init__(self, redis_url: str, interval_s: float = 0.2) -> None:
        self.log = StepLog()
        self._redis = Redis.from_url(redis_url, socket_timeout=2.0)
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="step-recorder", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pattern = subjects.instance_key("*")
        while not self._stop.wait(self._interval_s):
            with contextlib.suppress(RedisError, OSError):  # a missed read: the next one
                keys = list(self._redis.scan_iter(match=pattern, count=1000))
                for value in self._redis.mget(keys) if keys else []:
                    self._add(value)

    def _add(self, value: bytes | str | None) -> None:
        if value is None:
            return
        try:
            info = InstanceInfo.model_validate_json(value)
        except ValidationError:
            return
        with self._lock:
            self.log.add(info.instance_id, info.recent_steps)

    def take(self) -> Steps:
        with self._lock:
            return self.log.take()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._redis.close()
