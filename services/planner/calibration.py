"""The latency model calibrated on the running stack (pure): the workers time every engine
step and heartbeat the last ones (`StepSample`: whole prompts, or a batch of decodes); the
calibrator compares each with what the profile predicts for the same step and keeps, per
phase, the median of measured / predicted over a sliding window. The profile gives the
shape of the model (how time grows with tokens, batch and context, which a live workload
rarely spans widely enough to fit), the stack gives its level: steps slowed by everything
else the stack runs on the same cores, which a profile of the engine alone cannot see."""

from __future__ import annotations

import dataclasses
import statistics
from collections import deque

from pydantic import BaseModel

from services.planner.latency import LatencyModel
from services.planner.profiles import Profile
from shared.state import StepSample


class Calibration(BaseModel):
    """Measured / predicted step time per phase (1.0: as profiled), and the steps behind it."""

    prefill: float = 1.0
    decode: float = 1.0
    prefill_steps: int = 0
    decode_steps: int = 0

    def apply(self, profile: Profile) -> Profile:
        by_tp = {tp: co.slowed(self.prefill, self.decode) for tp, co in profile.by_tp.items()}
        return dataclasses.replace(profile, by_tp=by_tp)

    def differs(self, other: Calibration, by: float) -> bool:
        """Either phase's scale moved by more than the ratio `by` (e.g. 1.2)."""
        return any(max(a / b, b / a) > by for a, b in ((self.prefill, other.prefill),
                                                       (self.decode, other.decode)))


@dataclasses.dataclass
class Calibrator:
    latency: LatencyModel  # the profile's, for one device
    window: int = 200  # steps per phase
    min_steps: int = 10  # a phase's scale stays 1.0 until this many steps were seen

    def __post_init__(self) -> None:
        self.ratios: dict[str, deque[float]] = {"prefill": deque(maxlen=self.window),
                                                "decode": deque(maxlen=self.window)}
        self.seen: dict[str, int] = {}  # instance -> the last step taken from it

    def observe(self, instance: str, samples: list[StepSample]) -> int:
        """Take the samples of `instance` not seen before; how many were new."""
        last = self.seen.get(instance, 0)
        new = [s for s in samples if s.step > last and s.seconds > 0]
        for s in new:
            if s.prompts:
                predicted = self.latency.prefill_latency_s(sum(s.prompts),
                                                           sum(n * n for n in s.prompts))
                self.ratios["prefill"].append(s.seconds / predicted)
            elif s.batch:
                predicted = self.latency.decode_step_s(s.batch, s.context)
                self.ratios["decode"].append(s.seconds / predicted)
        if new:
            self.seen[instance] = max(s.step for s in new)
        return len(new)

    def forget(self, instance: str) -> None:
        self.seen.pop(instance, None)

    def calibration(self) -> Calibration:
        def scale(phase: str) -> float:
            ratios = self.ratios[phase]
            return statistics.median(ratios) if len(ratios) >= self.min_steps else 1.0

        return Calibration(prefill=scale("prefill"), decode=scale("decode"),
                           prefill_steps=len(self.ratios["prefill"]),
                           decode_steps=len(self.ratios["decode"]))


def replan_reason(found: Calibration, planned_on: Calibration, ratio: float,
                  min_steps: int) -> str | None:
    """Why the planner should plan again on `found` (None: it need not): both phases are
    measured over `min_steps` steps at least, and one has moved by more than `ratio` since
    the calibration the last plan was made on."""
    if min(found.prefill_steps, found.decode_steps) < min_steps or \
            not found.differs(planned_on, ratio):
        return None
    return (f"step times moved: prefill {found.prefill:.2f}x, decode {found.decode:.2f}x the "
            f"profile (were {planned_on.prefill:.2f}x, {planned_on.decode:.2f}x)")
