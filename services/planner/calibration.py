"""The latency model calibrated on the running stack (pure): the workers time every engine
step and heartbeat the last ones (`StepSample`: whole prompts, or a batch of decodes); the
calibrator compares each with what the profile predicts for the same step over a sliding
window, and fits per phase whichever of two corrections explains the steps better: a scale
(measured = k x predicted: steps slowed by everything else the stack runs on the same
cores) or a fixed time a step (measured = predicted + d: a per-step cost the profile's fit
misses, as on a host whose small steps cost more than the profiled one's, or a per-step
overhead of the stack). The profile keeps the shape of the model (how time grows with
tokens, batch and context, which a live workload rarely spans widely enough to fit); the
choice matters where the planner prices steps far larger than the live ones: on the
development VM a 16-token prefill step took 1.45x the profile but a 512-token one 1.0x,
which a scale would have priced at 1.45x and a fixed +34 ms at 1.04x."""

from __future__ import annotations

import dataclasses
import statistics
from collections import deque
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel

from services.planner.latency import Contention, LatencyModel
from services.planner.profiles import Profile
from shared.state import StepSample

Fit = Literal["scale", "offset"]


class Calibration(BaseModel):
    """Per phase: measured / predicted step time at the live steps (the median; 1.0: as
    profiled), the correction that fits them best, and the steps behind it."""

    prefill: float = 1.0
    decode: float = 1.0
    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_fit: Fit = "scale"  # "offset": the profile's times plus prefill_offset_s a step
    decode_fit: Fit = "scale"
    prefill_offset_s: float = 0.0
    decode_offset_s: float = 0.0

    def correction(self, phase: str) -> tuple[float, float]:
        """(scale, ms added a step) for the profile's step times of `phase`."""
        if getattr(self, f"{phase}_fit") == "offset":
            return 1.0, 1e3 * getattr(self, f"{phase}_offset_s")
        return getattr(self, phase), 0.0

    def apply(self, profile: Profile) -> Profile:
        """`profile` corrected, its measured pipelines alike. Steps timed live already ran
        beside whatever else the host ran, so a calibration made of them replaces the
        profile's contention (which would count that slowdown twice); one made of unloaded
        requests keeps it."""
        (prefill, prefill_ms), (decode, decode_ms) = (self.correction("prefill"),
                                                      self.correction("decode"))
        by_tp = {tp: co.slowed(prefill, decode, prefill_ms, decode_ms)
                 for tp, co in profile.by_tp.items()}
        pipelines = {shape: co.slowed(prefill, decode, prefill_ms, decode_ms)
                     for shape, co in profile.pipelines.items()}
        live = self.prefill_steps > 0 or self.decode_steps > 0
        return dataclasses.replace(profile, by_tp=by_tp, pipelines=pipelines,
                                   contention=Contention() if live else profile.contention)

    def describe(self, phase: str) -> str:
        """'1.45x the profile (+33 ms a step fits best)', for logs and `plan --live`."""
        _, plus_ms = self.correction(phase)
        fits = f" ({plus_ms:+.0f} ms a step fits best)" if plus_ms else ""
        return f"{getattr(self, phase):.2f}x the profile{fits}"

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
        # (predicted, measured) seconds of the last steps of each phase
        self.steps: dict[str, deque[tuple[float, float]]] = {
            "prefill": deque(maxlen=self.window), "decode": deque(maxlen=self.window)}
        self.seen: dict[str, int] = {}  # instance -> the last step taken from it

    def observe(self, instance: str, samples: list[StepSample],
                latency: LatencyModel | None = None) -> int:
        """Take the samples of `instance` not seen before, against what `latency` (the
        instance's own shape's, where it is not the one `self.latency` is of) predicts for
        them; how many were new."""
        model = latency or self.latency
        last = self.seen.get(instance, 0)
        new = [s for s in samples if s.step > last and s.seconds > 0]
        for s in new:
            if s.prompts or s.batch:
                self.steps["prefill" if s.prompts else "decode"].append(
                    (predicted_s(model, s), s.seconds))
        if new:
            self.seen[instance] = max(s.step for s in new)
        return len(new)

    def forget(self, instance: str) -> None:
        self.seen.pop(instance, None)

    def _constant_s(self, phase: str) -> float:
        """The smallest constant of the phase's fitted step times, in seconds."""
        co = self.latency.coefficients
        constants = [co.prefill[0]] if phase == "prefill" else [co.decode_small[0],
                                                                 co.decode_large[0]]
        return min(constants) / 1e3

    def calibration(self) -> Calibration:
        fields: dict[str, object] = {}
        for phase, steps in self.steps.items():
            fields[f"{phase}_steps"] = len(steps)
            if len(steps) >= self.min_steps:
                ratio, fit, offset_s = fit_steps(list(steps), self._constant_s(phase))
                fields |= {phase: ratio, f"{phase}_fit": fit, f"{phase}_offset_s": offset_s}
        return Calibration.model_validate(fields)


def predicted_s(latency: LatencyModel, step: StepSample) -> float:
    """What `latency` says `step` takes: its whole prompts, or its batch of decodes."""
    if step.prompts:
        return latency.prefill_latency_s(sum(step.prompts), sum(n * n for n in step.prompts))
    return latency.decode_step_s(step.batch, step.context)


def fit_steps(steps: list[tuple[float, float]], constant_s: float = float("inf"),
              spread: float = 1.5) -> tuple[float, Fit, float]:
    """(median measured / predicted, the better fit, its time a step) for (predicted,
    measured) pairs: a scale or a fixed time a step, each the median over the steps, the one
    whose median relative error is smaller. Steps of about one size (their predicted times'
    10th and 90th percentiles within `spread`) cannot tell the two apart: the fixed time
    then, which adds what was measured where it was measured and scales nothing beyond.
    Either way a fixed time is only taken within `constant_s` (the model's fixed part of a
    step) of zero: a per-step cost beyond a whole step's fixed part is a slowdown (the cores
    shared with other work: a few long steps among many short ones do not outvote the
    short ones' medians), and one below -`constant_s` (a host much faster than the profiled
    one) would price small steps below zero: the scale then."""
    ratio = statistics.median(m / p for p, m in steps)
    offset_s = statistics.median(m - p for p, m in steps)

    def error(predict: Callable[[float], float]) -> float:
        return statistics.median(abs(predict(p) - m) / m for p, m in steps)

    deciles = statistics.quantiles([p for p, _ in steps], n=10)
    alike = deciles[-1] <= spread * deciles[0]
    offset = abs(offset_s) <= constant_s and (
        alike or error(lambda p: p + offset_s) < error(lambda p: p * ratio))
    return ratio, "offset" if offset else "scale", offset_s if offset else 0.0


def replan_reason(found: Calibration, planned_on: Calibration, ratio: float,
                  min_steps: int) -> str | None:
    """Why the planner should plan again on `found` (None: it need not): both phases are
    measured over `min_steps` steps at least, and one has moved by more than `ratio` since
    the calibration the last plan was made on."""
    if min(found.prefill_steps, found.decode_steps) < min_steps or \
            not found.differs(planned_on, ratio):
        return None
    return (f"step times moved: prefill {found.describe('prefill')}, decode "
            f"{found.describe('decode')} (were {planned_on.prefill:.2f}x, "
            f"{planned_on.decode:.2f}x)")
