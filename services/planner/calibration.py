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
which a scale would have priced at 1.45x and a fixed +34 ms at 1.04x.

Steps that say when they ended are placed beside the steps the other instances of their host
were running (CPU cores share the memory bandwidth and caches): each phase is then calibrated
on its steps that ran alone, and the contention is measured on those that ran beside exactly
one neighbour's step, so a plan with another mix of instances on the host (another split,
colocated replicas) is priced as its steps would run, not at the level the current mix
happened to average. A phase with too few steps alone is calibrated on all its steps, which
then carry their contention (none is added on top)."""

from __future__ import annotations

import bisect
import dataclasses
import statistics
from collections import deque
from collections.abc import Callable, Iterable
from typing import Literal

from pydantic import BaseModel

from services.planner.latency import Contention, LatencyModel, Phase
from services.planner.profiles import Profile
from shared.state import StepSample

Fit = Literal["scale", "offset"]
# what a phase's correction was fitted on: nothing yet (the profile as it is), the steps that
# ran alone on their host, or all of them (their contention in the level)
Basis = Literal["profile", "alone", "all"]
PHASES: tuple[Phase, Phase] = ("prefill", "decode")


class Calibration(BaseModel):
    """Per phase: measured / predicted step time at the live steps (the median; 1.0: as
    profiled), the correction that fits them best, the steps it was fitted on, and how
    much longer the phase's steps took beside a neighbour's step of each phase (measured
    factors only, e.g. {"decode_by_decode": 1.6})."""

    prefill: float = 1.0
    decode: float = 1.0
    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_fit: Fit = "scale"  # "offset": the profile's times plus prefill_offset_s a step
    decode_fit: Fit = "scale"
    prefill_offset_s: float = 0.0
    decode_offset_s: float = 0.0
    prefill_basis: Basis = "profile"
    decode_basis: Basis = "profile"
    contention: dict[str, float] = {}

    def correction(self, phase: str) -> tuple[float, float]:
        """(scale, ms added a step) for the profile's step times of `phase`."""
        if getattr(self, f"{phase}_fit") == "offset":
            return 1.0, 1e3 * getattr(self, f"{phase}_offset_s")
        return getattr(self, phase), 0.0

    def apply(self, profile: Profile) -> Profile:
        """`profile` corrected, its measured pipelines alike, with the contention to price
        its steps with on top (`contention_over`)."""
        (prefill, prefill_ms), (decode, decode_ms) = (self.correction("prefill"),
                                                      self.correction("decode"))
        by_tp = {tp: co.slowed(prefill, decode, prefill_ms, decode_ms)
                 for tp, co in profile.by_tp.items()}
        pipelines = {shape: co.slowed(prefill, decode, prefill_ms, decode_ms)
                     for shape, co in profile.pipelines.items()}
        return dataclasses.replace(profile, by_tp=by_tp, pipelines=pipelines,
                                   contention=self.contention_over(profile.contention))

    def contention_over(self, profiled: Contention) -> Contention:
        """How a step of each phase slows beside a neighbour's, on top of this calibration:
        a phase fitted on its steps alone meets its neighbours as measured (as `profiled`
        where too few of its steps ran beside one of that phase); one fitted on all its
        steps already carries whatever contention they met, so none is added (it would
        count twice); one not fitted on steps (or on unloaded requests: bench compare's)
        keeps the profile's."""
        factors = dataclasses.asdict(profiled)
        for name in factors:
            basis = getattr(self, f"{name.split('_by_')[0]}_basis")
            if basis == "all":
                factors[name] = 1.0
            elif basis == "alone":
                factors[name] = self.contention.get(name, factors[name])
        return Contention(**factors)

    def describe(self, phase: str) -> str:
        """For logs and `plan --live`: '1.45x the profile (+33 ms a step fits best)', or
        '1.12x the profile alone, 1.62x beside a decode'."""
        _, plus_ms = self.correction(phase)
        alone = " alone" if getattr(self, f"{phase}_basis") == "alone" else ""
        fits = f" ({plus_ms:+.0f} ms a step fits best)" if plus_ms else ""
        beside = "".join(f", {factor:.2f}x beside a {name.split('_by_')[1]}"
                         for name, factor in sorted(self.contention.items())
                         if name.startswith(f"{phase}_by_"))
        return f"{getattr(self, phase):.2f}x the profile{alone}{fits}{beside}"

    def differs(self, other: Calibration, by: float) -> bool:
        """Either phase's scale, or a measured contention factor, moved by more than the
        ratio `by` (e.g. 1.2)."""
        pairs = [(self.prefill, other.prefill), (self.decode, other.decode)]
        pairs += [(self.contention.get(name, 1.0), other.contention.get(name, 1.0))
                  for name in self.contention.keys() | other.contention.keys()]
        return any(max(a / b, b / a) > by for a, b in pairs)


@dataclasses.dataclass(frozen=True)
class Timed:
    """A step as the calibrator keeps it."""

    instance: str
    host: str
    phase: Phase
    predicted_s: float  # what the profile says it takes
    seconds: float  # what it took
    ended: float  # wall clock; 0: not said (it is then never placed beside another step)
    share: float  # the share of it a neighbour's step slows, as the simulator prices it


def neighbours(steps: Iterable[Timed]) -> list[tuple[Timed, list[Phase]]]:
    """Each step that says when it ended, with the phases of the steps the other instances
    of its host were running at its midpoint (an instance runs one step at a time)."""
    timed = [t for t in steps if t.ended > 0]
    spans: dict[tuple[str, str], list[tuple[float, float, Phase]]] = {}
    for t in timed:
        spans.setdefault((t.host, t.instance), []).append((t.ended - t.seconds, t.ended, t.phase))
    for found in spans.values():
        found.sort()
    starts = {key: [start for start, _, _ in found] for key, found in spans.items()}
    out = []
    for t in timed:
        middle, beside = t.ended - t.seconds / 2, []
        for key, found in spans.items():
            if key[0] != t.host or key[1] == t.instance:
                continue
            i = bisect.bisect_right(starts[key], middle) - 1
            if i >= 0 and found[i][1] >= middle:
                beside.append(found[i][2])
        out.append((t, beside))
    return out


@dataclasses.dataclass
class Calibrator:
    latency: LatencyModel  # the profile's, for one device
    window: int = 200  # steps per phase
    min_steps: int = 10  # a phase's scale (or a contention factor) needs this many steps

    def __post_init__(self) -> None:
        self.steps: dict[Phase, deque[Timed]] = {phase: deque(maxlen=self.window)
                                                 for phase in PHASES}
        self.seen: dict[str, int] = {}  # instance -> the last step taken from it

    def observe(self, instance: str, samples: list[StepSample],
                latency: LatencyModel | None = None, host: str = "") -> int:
        """Take the samples of `instance` (on `host`) not seen before, against what
        `latency` (the instance's own shape's, where it is not the one `self.latency` is
        of) predicts for them; how many were new."""
        model = latency or self.latency
        last = self.seen.get(instance, 0)
        new = [s for s in samples if s.step > last and s.seconds > 0]
        for s in new:
            if s.prompts or s.batch:
                phase: Phase = "prefill" if s.prompts else "decode"
                share = 1.0 if s.prompts else max(model.reading_share(s.batch, s.context), 1e-3)
                self.steps[phase].append(Timed(instance, host, phase, predicted_s(model, s),
                                               s.seconds, s.ended, share))
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
        """Each phase's correction, fitted on its steps that ran alone where at least
        `min_steps` did (then with the contention of those that ran beside exactly one
        neighbour's step of a phase: the factor that prices them as they ran, at the share
        of the step it slows), else on all its steps."""
        placed = neighbours([*self.steps["prefill"], *self.steps["decode"]])
        fields: dict[str, object] = {}
        contention: dict[str, float] = {}
        for phase in PHASES:
            fields[f"{phase}_steps"] = len(self.steps[phase])
            alone = [t for t, beside in placed if t.phase == phase and not beside]
            basis: Basis = "alone" if len(alone) >= self.min_steps else "all"
            fitted_on = alone if basis == "alone" else list(self.steps[phase])
            if len(fitted_on) < self.min_steps:
                continue
            ratio, fit, offset_s = fit_steps([(t.predicted_s, t.seconds) for t in fitted_on],
                                             self._constant_s(phase))
            fields |= {phase: ratio, f"{phase}_fit": fit, f"{phase}_offset_s": offset_s,
                       f"{phase}_basis": basis}
            if basis == "all":
                continue
            scale, plus_s = (1.0, offset_s) if fit == "offset" else (ratio, 0.0)
            for other in PHASES:
                pairs = [(t.seconds / (scale * t.predicted_s + plus_s), t.share)
                         for t, beside in placed if t.phase == phase and beside == [other]]
                if len(pairs) >= self.min_steps:
                    slower = statistics.median(r for r, _ in pairs)
                    share = statistics.median(w for _, w in pairs)
                    contention[f"{phase}_by_{other}"] = max(1.0, 1.0 + (slower - 1.0) / share)
        return Calibration.model_validate(fields | {"contention": contention})


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
