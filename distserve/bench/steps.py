"""The engine steps a stack's workers ran during a benchmark: each worker heartbeats its last
steps (`InstanceInfo.recent_steps`, every 0.5 s), and a recorder reads them from Redis while
the benchmark runs. They are the step times the stack itself took at each rate, beside
everything else it ran, which the online planner calibrates its latency model on
(services/planner/calibration.py); `bench compare --simulate` simulates each rate on them
too, which tells the simulator's errors from the profile's."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import ValidationError
from redis import Redis
from redis.exceptions import RedisError

from services.planner.calibration import Calibration, Calibrator
from services.planner.latency import LatencyModel
from services.planner.noise import Noise
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


def calibrator_of(steps: Steps, latency: LatencyModel, min_steps: int = 10) -> Calibrator:
    """The online planner's calibrator, fed `steps`: a run's steps of the instances of one
    machine, every step each ran until the run's last one ended."""
    calibrator = Calibrator(latency, window=1 << 30, min_steps=min_steps, whole=True)
    for instance, samples in steps.items():
        calibrator.observe(instance, samples)
    ends = [s.ended for samples in steps.values() for s in samples if s.ended > 0]
    if ends:  # a run's steps, recorded whole: between them the instances were idle
        for instance in steps:
            calibrator.timeline.complete(instance, max(ends))
    return calibrator


def calibration_of(steps: Steps, latency: LatencyModel) -> Calibration:
    """What the online planner would make of `steps`: each phase's correction of `latency`
    that fits them best (on the steps that ran alone where enough did, with the contention
    of those beside another instance's; 1.0 for a phase with fewer than the calibrator's
    minimum of steps)."""
    return calibrator_of(steps, latency).calibration()


@dataclasses.dataclass(frozen=True)
class Live:
    """A profile fitted to the steps a stack ran, the calibration that fitted it, and how
    the steps scattered around it (`noise.Noise`; the profile itself prices every step at
    its fit)."""

    calibration: Calibration
    profile: Profile
    noise: Noise = dataclasses.field(default_factory=Noise)

    def noisy(self, seed: int) -> Profile:
        """The profile whose simulated steps scatter as the stack's did, drawn from `seed`."""
        return dataclasses.replace(self.profile,
                                   noise=dataclasses.replace(self.noise, seed=seed))

    def to_json(self) -> dict[str, Any]:
        return self.calibration.model_dump()

    def describe(self) -> str:
        """'prefill 1.12, decode 1.05, decode beside a decode 1.60' (measured factors)."""
        c = self.calibration
        return f"prefill {c.prefill:.2f}, decode {c.decode:.2f}" + "".join(
            f", {name.replace('_by_', ' beside a ')} {factor:.2f}"
            for name, factor in sorted(c.contention.items()))

    def describe_noise(self) -> str:
        """'prefill x0.97-1.06 (p10-p90), mean 1.01, lag-1 0.51; decode ...' ('-': none)."""
        return "; ".join(f"{phase} {found.describe()}" for phase in ("prefill", "decode")
                         if (found := self.noise.of(phase)) is not None) or "-"


def live_profile(steps: Steps, profile: Profile, min_steps: int = 10) -> Live:
    """`profile` as the steps in `steps` ran, calibrated as the online planner calibrates
    (services/planner/calibration.py): each phase on its steps that ran alone, with the
    contention measured on those that ran beside one other instance's step; without the
    steps' end times, on all of them, which already hold whatever contention they met. With
    the spread and order of the steps' times around that fit (`Calibrator.noise`)."""
    calibrator = calibrator_of(steps, profile.latency(1, 1), min_steps)
    found = calibrator.calibration()
    return Live(found, found.apply(profile), calibrator.noise(found))


def steps_to_json(steps: Steps) -> dict[str, list[list[Any]]]:
    """Compact: [step, prompts, batch, context, seconds, ended] a step, and the prompts'
    tokens computed before it where a chunk's were (a chunked step)."""
    return {instance: [[s.step, s.prompts, s.batch, s.context, round(s.seconds, 6),
                        round(s.ended, 6)] + ([s.done] if s.done else []) for s in samples]
            for instance, samples in steps.items()}


def steps_from_json(data: dict[str, Sequence[Sequence[Any]]]) -> Steps:
    return {instance: [StepSample(step=row[0], prompts=row[1], batch=row[2], context=row[3],
                                  seconds=row[4], ended=row[5] if len(row) > 5 else 0.0,
                                  done=row[6] if len(row) > 6 else [])
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
