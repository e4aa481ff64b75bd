"""The latency model calibrated on the running stack (pure): the workers time every engine
step and heartbeat the last ones (`StepSample`: whole prompts, a batch of decodes, or
prompt chunks with decodes riding along); the calibrator compares each with what the
profile predicts for the same step over a sliding window, and fits per phase whichever of
two corrections explains the steps better: a scale
(measured = k x predicted: steps slowed by everything else the stack runs on the same
cores) or a fixed time a step (measured = predicted + d: a per-step cost the profile's fit
misses, as on a host whose small steps cost more than the profiled one's, or a per-step
overhead of the stack). The profile keeps the shape of the model (how time grows with
tokens, batch and context, which a live workload rarely spans widely enough to fit); the
choice matters where the planner prices steps far larger than the live ones: on the
development VM a 16-token prefill step took 1.45x the profile but a 512-token one 1.0x,
which a scale would have priced at 1.45x and a fixed +34 ms at 1.04x.

Steps that say when they ended are placed beside the steps the other instances of their
machine were running (CPU cores share the memory bandwidth and caches; `Timeline`: only
where every neighbour's record says what it ran then, not at the edges of what its
heartbeats have told, at eight moments through each step): each phase is then calibrated on
its steps that ran alone, and the contention is fitted on those that ran beside others' (how
much slower they ran while beside them, as the simulator prices it), so a plan with another
mix of instances on the machine (another split, colocated replicas) is priced as its steps
would run, not at the level the current mix happened to average. A phase with too few steps
alone is calibrated on all its steps, which then carry their contention (none is added on
top)."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, model_validator
from scipy.optimize import brentq, least_squares

from services.planner.latency import PHASES, Contention, LatencyModel, Phase, chunk_terms
from services.planner.noise import Noise, fit_noise
from services.planner.profiles import Profile
from services.planner.simulator.core import added_by
from services.planner.timeline import Timeline, phase_of
from shared.state import StepSample

Fit = Literal["scale", "offset"]
# what a phase's correction was fitted on: nothing yet (the profile as it is), the steps that
# ran alone on their machine, or all of them (their contention in the level)
Basis = Literal["profile", "alone", "all"]
MOMENTS = 8  # a step's neighbours are looked up this many times through it
MOST_SLOWED = 10.0  # a contention factor is fitted as at most this
FEWEST = 3  # steps a phase's level is fitted on at least, however long they ran
# a chunked step says something of its prompt tokens where they are this much of it at least
# (as predicted; the rest the decodes riding along)
OWN_SHARE = 0.3
# ... and where it computes this many of them at least: the profile measures prompts from 16
# tokens, and a step of a few (a chunked prompt's tail: 2 tokens left by 510 beside 2
# decodes) reads the weights as a decode step does, which the prefill model's constant and
# cost a token do not price (on the Zen 4 a 2-token prompt took 28 ms, priced 16). Near
# capacity few steps run alone, and a short one is likelier to: a fixed:512:32 run's chunked
# replicas at 0.861 req/s ran 4 of 39 prompt steps alone, 2 of them tails, and the level
# fitted on those 4 read 1.50x where the long steps ran 1.11x.
FEWEST_PROMPT_TOKENS = 16
# a phase's fit is set where its steps add up to what they took over this many steps at
# least (`fit_steps`), else at its median: over a few steps one stalled one (a collection,
# a neighbour's burst) would move the mean by what the online planner replans on, and again
# as it leaves the window
MEAN_FROM = 20
# the phases of the steps a step's machine's other instances ran at each of its moments
Moments = tuple[tuple[Phase, ...], ...]
ALONE: Moments = ((),) * MOMENTS
NO_CONTENTION = Contention()


class Calibration(BaseModel):
    """Per phase: measured / predicted step time at the live steps (their total over their
    predicted total; 1.0: as profiled), the correction that fits them best, the steps it
    was fitted on, and the contention measured beside a neighbour's step of each phase
    (`Contention`'s factors; measured ones only, e.g. {"decode_by_decode": 1.6})."""

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

    @model_validator(mode="before")
    @classmethod
    def _fitted_on_all_before_bases(cls, data: Any) -> Any:
        """A calibration saved before phases said what they were fitted on was fitted on
        all the steps, and priced no contention on top: it still does."""
        if isinstance(data, dict) and not {"prefill_basis", "decode_basis"} & data.keys() \
                and data.get("prefill_steps", 0) + data.get("decode_steps", 0) > 0:
            return data | {"prefill_basis": "all", "decode_basis": "all"}
        return data

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

    def differs(self, other: Calibration, by: float,
                profiled: Contention = NO_CONTENTION) -> bool:
        """Either phase's scale, or a contention factor as each prices it over the profile's
        (`profiled`), moved by more than the ratio `by` (e.g. 1.2)."""
        mine, theirs = (dataclasses.asdict(c.contention_over(profiled)) for c in (self, other))
        pairs = [(self.prefill, other.prefill), (self.decode, other.decode)]
        pairs += [(mine[name], theirs[name]) for name in mine]
        return any(max(a / b, b / a) > by for a, b in pairs)


@dataclasses.dataclass(frozen=True, eq=False)
class Timed:
    """A step as the calibrator keeps it (each one itself: hashed by identity)."""

    instance: str
    phase: Phase
    predicted_s: float  # what the profile says it takes
    seconds: float  # what it took
    ended: float  # wall clock; 0: not said (it is then never placed beside another step)
    machine: str
    at: float  # what it ages by: its end, else the newest end its machine had told of then
    riding_s: float  # of `predicted_s`, what decodes beside its prompt chunks add
    prompt_tokens: int  # the prompt tokens it computed

    def corrected_s(self, scale: float, plus_s: float, riding: float) -> float:
        """Its time on the profile corrected: its phase's part by `scale` and `plus_s`, the
        decodes riding along by the decode phase's scale."""
        return scale * (self.predicted_s - self.riding_s) + plus_s + riding * self.riding_s


@dataclasses.dataclass
class Calibrator:
    latency: LatencyModel  # the profile's, for one device
    window: int = 2000  # steps per phase at most
    window_s: float = 120.0  # of the last this many seconds (by the newest step heard)
    min_steps: int = 10  # a phase's level (a factor: half as many steps' time) needs this many
    min_seconds: float = 2.0  # or this much of them (a few long prefills)
    # a step's neighbours are taken as its machine's record told them once a step this much
    # newer was heard, and its machine heard this long (every instance that ran beside it
    # has heartbeated since)
    settle_s: float = Timeline.GONE_S
    late_s: float = 60.0  # a step is heard within this of its machine's newest step heard
    # (steps age by the newest step of any machine: a host whose clock lags the others' by
    # more than `window_s` has its steps aged at once)
    whole: bool = False  # the steps are a record given whole (bench compare's): none is late
    # the other models its steps are priced on (a prefill profile's, where the prefill workers
    # compute in another dtype): a correction must suit them all (`_constant_s`)
    also: tuple[LatencyModel, ...] = ()

    def __post_init__(self) -> None:
        self.steps: dict[Phase, deque[Timed]] = {phase: deque(maxlen=self.window)
                                                 for phase in PHASES}
        self.seen: dict[str, int] = {}  # instance -> the last step taken from it
        self.timeline = Timeline(keep=max(4000, 20 * self.window))
        self._settled: dict[Timed, Moments | None] = {}  # steps placed for good (or nowhere)
        self._unsettled: list[Timed] = []  # steps in the windows not placed for good yet
        self._newest: dict[str, float] = {}  # machine -> the latest end of its steps heard
        self._listening: dict[str, tuple[float, float]] = {}  # machine -> heard since, last

    def observe(self, instance: str, samples: list[StepSample],
                latency: LatencyModel | None = None, machine: str = "",
                heard_at: float = 0.0, steps: int = -1, busy_since: float = -1.0) -> int:
        """Take the samples of `instance` (on `machine`) not seen before, against what
        `latency` (the instance's own shape's, where it is not the one `self.latency` is
        of) predicts for them, from a heartbeat at `heard_at` that counted `steps` steps so
        far (-1: not from a heartbeat) and said since when a step has been running
        (`Timeline.heard`); how many were new."""
        if heard_at > 0 and 0 <= steps < self.timeline.counted(instance):
            self.forget(instance)  # counting from 0 again: restarted under its old name
        model = latency or self.latency
        last = self.seen.get(instance, 0)
        new = [s for s in samples if s.step > last and s.seconds > 0]
        self.timeline.add(instance, machine, new)
        if steps >= 0:
            self.timeline.heard(instance, heard_at, steps, busy_since)
        if heard_at > 0:  # heard since `since` without a silence of `settle_s`
            since, latest = self._listening.get(machine, (heard_at, heard_at))
            if heard_at - latest > self.settle_s:
                since = heard_at
            self._listening[machine] = (since, max(latest, heard_at))
        self._newest[machine] = max([self._newest.get(machine, -math.inf)] +
                                    [s.ended for s in new])
        newest = max(self._newest.values())
        for s in new:
            if not (s.prompts or s.batch) or (not self.whole and
                                             0 < s.ended < newest - self.window_s):
                continue  # nothing to price, or too old for the window by now
            phase = phase_of(s)
            predicted, riding = predicted_s(model, s), riding_s(model, s)
            timed = Timed(instance, phase, predicted, s.seconds, s.ended, machine,
                          s.ended if s.ended > 0 else newest, riding, sum(s.prompts))
            self.steps[phase].append(timed)
            if s.ended > 0 and not self.whole:
                self._unsettled.append(timed)
        if new:
            self.seen[instance] = max(s.step for s in new)
        if not self.whole:
            for kept in self.steps.values():  # heard in the order they ran, near enough
                while kept and kept[0].at < newest - self.window_s:
                    kept.popleft()
            self._trim(newest - self.window_s)
        return len(new)

    def _trim(self, window_from: float) -> None:
        """Place for good the steps whose neighbours' records have told (`settle_s` after
        them, and after their machine has been heard for `settle_s`: its other instances
        may not have been heard yet), or nowhere those still unknown once every neighbour's
        record has run past them (beside a neighbour's unpriced steps); and drop from the
        timeline what no step will be placed on any more: spans older than the steps still
        to be placed and than steps yet to be heard can be (`late_s`). A busy decode
        instance's record (50 steps a second) would otherwise outgrow a window of prefills
        minutes long (or be cut by count, and the oldest prefills placed nowhere). Steps
        of a machine not heard from (no heartbeats) are placed when asked (`placed`)."""
        if len(self._settled) > 2 * sum(map(len, self.steps.values())) + 64:
            kept = {t for steps in self.steps.values() for t in steps}  # the rest: gone
            self._settled = {t: m for t, m in self._settled.items() if t in kept}
        oldest = {machine: newest - self.late_s for machine, newest in self._newest.items()
                  if machine in self._listening}
        unsettled = []
        for t in self._unsettled:
            if t.at < window_from:
                continue  # gone from its window
            since, latest = self._listening.get(t.machine, (0.0, 0.0))
            if latest - since >= self.settle_s and \
                    t.ended <= self._newest[t.machine] - self.settle_s:
                moments = self.moments(t)
                if moments is not None or self.timeline.told(t.instance, t.ended):
                    self._settled[t] = moments  # None: never to be told
                    continue
            if t.machine in oldest:
                oldest[t.machine] = min(oldest[t.machine], t.ended - t.seconds)
            unsettled.append(t)
        self._unsettled = unsettled
        for machine, before in oldest.items():
            self.timeline.trim(machine, before)

    def forget(self, instance: str) -> None:
        self.seen.pop(instance, None)
        machine = self.timeline.machine.get(instance)
        self.timeline.forget(instance)
        if machine not in self.timeline.machine.values():
            self._listening.pop(machine or "", None)  # heard again: its instances told anew

    def _constant_s(self, phase: str) -> float:
        """The smallest constant of the phase's fitted step times, in seconds, of every model
        the correction prices."""
        constants = []
        for model in (self.latency, *self.also):
            co = model.coefficients
            constants += [co.prefill[0]] if phase == "prefill" else [co.decode_small[0],
                                                                      co.decode_large[0]]
        return min(constants) / 1e3

    def _own(self, phase: Phase) -> list[tuple[Timed, Moments | None]]:
        """The phase's steps that say something of it (`OWN_SHARE`), placed (`placed`);
        of prompt steps those of `FEWEST_PROMPT_TOKENS` at least, where enough for a level
        are (a workload of short prompts is calibrated on the steps it runs)."""
        own = [(t, moments) for t, moments in self.placed(phase)
               if t.predicted_s - t.riding_s >= OWN_SHARE * t.predicted_s]
        long = [(t, moments) for t, moments in own
                if phase == "decode" or t.prompt_tokens >= FEWEST_PROMPT_TOKENS]
        return long if self._enough_for_level([t for t, _ in long]) else own

    def placed(self, phase: Phase) -> list[tuple[Timed, Moments | None]]:
        """The phase's steps, each with what its machine's other instances ran beside it."""
        settled = self._settled
        return [(t, settled[t] if t in settled else self.moments(t)) for t in self.steps[phase]]

    def moments(self, t: Timed) -> Moments | None:
        """The phases of the steps the other instances of `t`'s machine ran at `MOMENTS`
        moments evenly through it; None where one of those is not known."""
        if t.ended <= 0:
            return None
        out = []
        for k in range(MOMENTS):
            beside = self.timeline.beside(
                t.instance, t.ended - t.seconds * (MOMENTS - k - 0.5) / MOMENTS)
            if beside is None:
                return None
            out.append(tuple(beside))
        return tuple(out)

    def _enough_for_level(self, steps: list[Timed]) -> bool:
        """`min_steps` steps, or `min_seconds` of at least `FEWEST` (a few long prefills)."""
        return len(steps) >= self.min_steps or (
            len(steps) >= FEWEST and sum(t.seconds for t in steps) >= self.min_seconds)

    def calibration(self) -> Calibration:
        """Each phase's correction, fitted on its steps that ran alone on their machine where
        `min_steps` did (or `min_seconds` of them), with the contention fitted on those that
        ran beside other instances' steps (`_factors`), else on all its steps. Where
        `MEAN_FROM` or more of those beside a neighbour ran no slower in all than the level
        of those alone priced them (every factor found at 1), they ran as if alone, and the
        level is fitted on them too: a neighbour does not speed a step up, so the few steps
        alone near capacity read high by chance (on a Zen 3's humaneval run, the prefill
        instance at 1.15 req/s ran 4 of 54 steps alone, at 1.30x the profile where the 50
        beside the decodes averaged 1.23x; priced at the 4, the simulated prefills took 28%
        longer than measured)."""
        fields: dict[str, object] = {}
        contention: dict[str, float] = {}
        riding = 1.0  # the decode phase's scale, which decodes riding along a chunk take
        for phase in ("decode", "prefill"):  # decode first: a chunked step's decodes are priced
            fields |= {f"{phase}_steps": len(self.steps[phase]), f"{phase}_basis": "profile"}
            # at that phase's correction, and the step's own part is what is left of it
            placed = self._own(phase)
            alone = [t for t, moments in placed if moments == ALONE]
            basis: Basis = "alone" if self._enough_for_level(alone) else "all"
            fitted_on = alone if basis == "alone" else [t for t, _ in placed]
            if not self._enough_for_level(fitted_on):
                continue
            ratio, fit, offset_s = self._level(phase, fitted_on, riding)
            scale, plus_s = (1.0, offset_s) if fit == "offset" else (ratio, 0.0)
            factors: dict[Phase, float] = {}
            if basis == "alone":
                beside = [(t, moments) for t, moments in placed
                          if moments is not None and moments != ALONE]
                factors, summed = self._factors(phase, beside, scale, plus_s, riding)
                if summed and max(factors.values()) <= 1.0:
                    as_alone = [t for t, moments in beside
                                if {q for m in moments for q in m} <= factors.keys()]
                    ratio, fit, offset_s = self._level(phase, alone + as_alone, riding)
                    scale = 1.0 if fit == "offset" else ratio
            fields |= {phase: ratio, f"{phase}_fit": fit, f"{phase}_offset_s": offset_s,
                       f"{phase}_basis": basis}
            contention |= {f"{phase}_by_{other}": factor for other, factor in factors.items()}
            if phase == "decode":
                riding = scale
        return Calibration.model_validate(fields | {"contention": contention})

    def _level(self, phase: Phase, steps: list[Timed], riding: float) -> tuple[float, Fit, float]:
        """`fit_steps` on `steps`' own parts (what decodes riding along a chunk take at the
        decode phase's scale `riding` left out)."""
        return fit_steps([(t.predicted_s - t.riding_s, t.seconds - riding * t.riding_s)
                          for t in steps], self._constant_s(phase))

    def noise(self, found: Calibration, min_steps: int = 20) -> Noise:
        """How each phase's steps scatter around `found` (this calibrator's calibration):
        the ratios of their times to what the corrected profile prices them at, each
        instance's in the order they ran (`noise.fit_noise`); none for a phase fitted on no
        steps or on fewer than `min_steps`. A phase fitted on its steps alone prices each
        step with the contention of the steps beside it, as the simulator does (`core.Host`:
        its time alone over its mean pace through its moments; a step whose neighbours are
        not known is left out); one fitted on all of them prices none (its level has it).
        The ratios are scaled so that their mean is the steps' total over their priced total:
        the simulator draws one for a step of any size, and where short steps ran relatively
        slower than long ones the ratios' mean is above that (a level that adds up: 1; one
        at the median, below `MEAN_FROM` steps: the tail it leaves out)."""
        riding = found.correction("decode")[0]
        contention = found.contention_over(self.latency.contention)
        fitted: dict[str, Any] = {}
        for phase in PHASES:
            basis = getattr(found, f"{phase}_basis")
            if basis == "profile":
                continue
            scale, plus_ms = found.correction(phase)
            added = added_by(contention, phase)
            runs: defaultdict[str, list[float]] = defaultdict(list)
            took_s = priced_s = 0.0
            for t, moments in sorted(self._own(phase), key=lambda placed: placed[0].ended):
                corrected = t.corrected_s(scale, plus_ms / 1e3, riding)
                if corrected <= 0:
                    continue
                if basis == "alone":  # at its pace beside its neighbours, as `Host` runs it
                    if moments is None:
                        continue
                    corrected /= statistics.fmean(
                        1.0 / (1.0 + sum(added[q] for q in beside)) for beside in moments)
                runs[t.instance].append(t.seconds / corrected)
                took_s, priced_s = took_s + t.seconds, priced_s + corrected
            ratios = [r for run in runs.values() for r in run]
            over = statistics.fmean(ratios) * priced_s / took_s if ratios else 1.0
            fitted[phase] = fit_noise([[r / over for r in run] for run in runs.values()],
                                      min_steps)
        return Noise(**fitted)

    def _factors(self, phase: Phase, steps: list[tuple[Timed, Moments]], scale: float,
                 plus_s: float, riding: float = 1.0) -> tuple[dict[Phase, float], bool]:
        """The contention factors that price `phase`'s `steps` (each with what ran beside
        it) as they ran on the corrected profile (`scale` x predicted + `plus_s`), as the
        simulator runs them (core.Host, processor sharing): a step of W seconds alone runs at
        the pace 1/g while its neighbours run steps of phases q, g = 1 + sum(f_q - 1), so it
        takes T = W / mean(1/g) over its moments. Fitted together (one step may meet both
        phases, or two steps at once), on log T, robustly (below `MEAN_FROM` steps a few
        slowed by something else do not move them; from there their total does, below),
        within [1, MOST_SLOWED], to 3 decimals; each factor given where steps ran beside that
        phase for half of `min_steps` steps' time (or `min_seconds`).

        Over `MEAN_FROM` steps or more the factors given are then set where the steps add up,
        as the level is (`fit_steps`): what they add is scaled alike (raised alike from none
        where the robust fit found none for any of them) until the steps' priced times add
        up to what they took (the factors of phases met too briefly to be given are priced
        at the profile's, as the simulator prices them); and whether they were so set. The
        robust fit alone lands near the steps' median slowdown, and a neighbour's slowdown
        has a tail: on a Zen 3 EPYC's humaneval run (13 rates of three systems) the decode
        steps beside a neighbour took 1.3-4.9% more than such factors priced, while those
        alone averaged their level, and the simulated decode runs were short by up to 5%."""
        took, alone, counts = [], [], []
        for t, moments in steps:
            corrected = t.corrected_s(scale, plus_s, riding)
            if corrected <= 0 or t.seconds <= 0:
                continue  # a fixed time a step below a shape's own constant: no pace to tell
            took.append(t.seconds)
            alone.append(corrected)
            counts.append([[m.count(q) for m in moments] for q in PHASES])
        if not took:
            return {}, False
        seconds, n = np.array(took), np.array(counts, dtype=float)  # n: [step, phase, moment]
        measured = np.log(seconds / np.array(alone))
        beside = (n > 0).mean(axis=2)  # [step, phase]: the share of each step beside it

        def priced(added: np.ndarray) -> np.ndarray:  # added: f - 1 by phase; T / W a step
            slowdown = 1.0 + np.einsum("spm,p->sm", n, added)
            return np.asarray(1.0 / (1.0 / slowdown).mean(axis=1))

        fitted = least_squares(lambda added: np.log(priced(added)) - measured,
                               np.full(len(PHASES), 0.1), loss="soft_l1",
                               f_scale=0.05, bounds=(0.0, MOST_SLOWED - 1.0),
                               xtol=1e-10, ftol=1e-10, gtol=1e-10).x
        fitted[~beside.any(axis=0)] = 0.0  # nothing moved a phase no step met from the start
        given = (beside.sum(axis=0) >= self.min_steps / 2) | (
            beside.T @ seconds >= self.min_seconds)
        summed = len(took) >= MEAN_FROM and bool(given.any())
        if summed:
            alone_s = np.array(alone)  # scaled alike; alike from 0 where the fit found none
            profiled = added_by(self.latency.contention, phase)
            kept = np.where(given, 0.0, [profiled[q] for q in PHASES])
            toward = np.where(given, fitted, 0.0)
            if toward.max() <= 0:
                toward = given.astype(float)

            def over(scale: float) -> float:  # the steps' time over their priced time
                priced_s = alone_s * priced(kept + scale * toward)
                return float(seconds.sum() / priced_s.sum()) - 1.0

            most = (MOST_SLOWED - 1.0) / toward.max()
            fitted = kept + toward * (0.0 if over(0.0) <= 0 else most if over(most) >= 0
                                      else brentq(over, 0.0, most, xtol=1e-9))
        return {q: round(1.0 + float(fitted[j]), 3) for j, q in enumerate(PHASES)
                if given[j]}, summed


def predicted_s(latency: LatencyModel, step: StepSample) -> float:
    """What `latency` says `step` takes: its prompt tokens (a chunk attends to the tokens
    computed before it too) and what its decodes add to them (`riding_s`), or its batch of
    decodes alone."""
    if step.prompts:
        done = step.done or [0] * len(step.prompts)
        terms = chunk_terms(zip(step.prompts, done, strict=True))
        return latency.prefill_latency_s(*terms) + riding_s(latency, step)
    return latency.decode_step_s(step.batch, step.context)


def riding_s(latency: LatencyModel, step: StepSample) -> float:
    """What `step`'s decodes add to its prompt tokens (0: decodes alone, or none)."""
    return latency.riding_ms(step.batch, step.context) / 1e3 if step.prompts else 0.0


def fit_steps(steps: list[tuple[float, float]], constant_s: float = float("inf"),
              spread: float = 1.5) -> tuple[float, Fit, float]:
    """(measured / predicted, the better fit, its time a step) for (predicted, measured)
    pairs: a scale or a fixed time a step, the one whose median relative error is smaller
    (each taken at its median over the steps to choose). Steps of about one size (their
    predicted times' 10th and 90th percentiles within `spread`) cannot tell the two apart:
    the fixed time then, which adds what was measured where it was measured and scales
    nothing beyond. Either way a fixed time is only taken within `constant_s` (the model's
    fixed part of a step) of zero: a per-step cost beyond a whole step's fixed part is a
    slowdown (the cores shared with other work: a few long steps among many short ones do
    not outvote the short ones' medians), and one below -`constant_s` (a host much faster
    than the profiled one) would price small steps below zero: the scale then.

    The fit chosen is set at its mean over the steps (`MEAN_FROM` of them at least), not its
    median: a request's time is its steps' sum, which a level at the median leaves short
    wherever the steps' spread has a tail (on the Zen 4, over 58 runs' fits, the stack's
    decode steps averaged 2.4% above their median, up to 7%, and bench compare's simulated
    decode runs were short by as much). Set so that the steps add up to what they took: a
    fixed time at the steps' mean difference, a scale at their total over their predicted
    total (the mean of their ratios weighs a 16-token prompt's as much as a 1,000-token one's,
    and on a Zen 3's humaneval run priced the prompt steps up to 2.1% over their total). A
    fixed time a step whose mean is beyond `constant_s` is a slowdown as above: the scale
    then."""
    ratio = statistics.median(m / p for p, m in steps)
    offset_s = statistics.median(m - p for p, m in steps)

    def error(predict: Callable[[float], float]) -> float:
        return statistics.median(abs(predict(p) - m) / m for p, m in steps)

    deciles = statistics.quantiles([p for p, _ in steps], n=10)
    alike = deciles[-1] <= spread * deciles[0]
    offset = abs(offset_s) <= constant_s and (
        alike or error(lambda p: p + offset_s) < error(lambda p: p * ratio))
    if len(steps) >= MEAN_FROM:
        ratio = sum(m for _, m in steps) / sum(p for p, _ in steps)
        offset_s = statistics.fmean(m - p for p, m in steps)
        offset = offset and abs(offset_s) <= constant_s
    return ratio, "offset" if offset else "scale", offset_s if offset else 0.0


def replan_reason(found: Calibration, planned_on: Calibration, ratio: float,
                  min_steps: int, profiled: Contention = NO_CONTENTION) -> str | None:
    """Why the planner should plan again on `found` (None: it need not): both phases are
    measured over `min_steps` steps at least, and a scale or a contention factor (priced
    over the profile's, `profiled`) has moved by more than `ratio` since the calibration the
    last plan was made on."""
    if min(found.prefill_steps, found.decode_steps) < min_steps or \
            not found.differs(planned_on, ratio, profiled):
        return None
    return (f"step times moved: prefill {found.describe('prefill')}, decode "
            f"{found.describe('decode')} (were {planned_on.describe('prefill')}, "
            f"{planned_on.describe('decode')})")
