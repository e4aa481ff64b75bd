"""When each instance of a machine ran its engine steps, as far as its heartbeats tell
(pure): what the calibrator places each step beside (services/planner/calibration.py), so
that a phase is calibrated on its steps that ran alone and the contention on those that ran
beside another instance's."""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Literal

from services.planner.latency import Phase
from shared.state import StepSample

Span = tuple[float, float, Phase | None]  # start, end, phase (None: steps ran, none priced)


class Timeline:
    """When each instance ran its steps, as far as its heartbeats tell (pure): the priced
    steps it reported, and, between two of them whose numbers skip, steps that ran unpriced
    (steps a heartbeat's window dropped, a pipeline's micro-batches) at times unknown. An
    instance's moments are known from its first reported step's start to its last one's end, idle
    between steps numbered one after the other; past its last step (or before its first),
    idle until a heartbeat that counted no step since (none at all) and said none was
    running (or since when one was), and running nothing once it stopped heartbeating
    (`GONE_S`); else not known (it may be mid-step)."""

    GONE_S = 5.0
    FORGET_S = 600.0
    FIRST_STEP_S = 3.0  # how long a step may be, for an instance that has run none yet

    def __init__(self, keep: int = 4000) -> None:
        self.machine: dict[str, str] = {}  # instance -> the machine it runs on
        self._spans: dict[str, list[Span]] = {}  # in order of their starts
        self._last: dict[str, tuple[int, float]] = {}  # instance -> its last step, its end
        self._longest: dict[str, float] = {}
        self._idle_until: dict[str, float] = {}
        self._idle_before: dict[str, float] = {}  # it ran no step before this
        self._heard: dict[str, float] = {}  # instance -> its last heartbeat
        self._counted: dict[str, int] = {}  # instance -> the steps its last heartbeat counted
        self._first: dict[str, float] = {}  # instance -> its first recorded step's start
        self._forgotten: dict[str, float] = {}  # machine -> up to when a forgotten record ran
        self._keep = keep

    def add(self, instance: str, machine: str, samples: Iterable[StepSample]) -> None:
        """`instance`'s steps (those not added before; none for an instance whose steps are
        not priced, which then makes its machine's every step unknown)."""
        self.machine[instance] = machine
        spans = self._spans.setdefault(instance, [])
        for s in sorted(samples, key=lambda s: s.step):
            last = self._last.get(instance)
            if s.ended <= 0 or (last is not None and s.step <= last[0]):
                continue
            start = s.ended - s.seconds
            if last is not None and s.step > last[0] + 1:  # unpriced: when, not known
                spans.append((last[1], start, None))
            spans.append((start, s.ended, phase_of(s)))
            self._first.setdefault(instance, start)
            self._last[instance] = (s.step, s.ended)
            self._longest[instance] = max(self._longest.get(instance, 0.0), s.seconds)
        if len(spans) > 2 * self._keep:  # a bound on memory, whatever the calibrator asks
            del spans[:-self._keep]

    def trim(self, machine: str, before: float) -> None:
        """Drop the spans of `machine`'s instances that ended before `before` (no step left
        to place needs them) but the last of them: what ran from its end is still told."""
        for instance, where in self.machine.items():
            if where == machine:
                spans = self._spans[instance]
                ends = bisect.bisect_left(spans, before, key=lambda span: span[1])
                del spans[:max(0, ends - 1)]

    def told(self, instance: str, moment: float) -> bool:
        """Whether the record of `instance`'s machine has told all it will of `moment`: each
        of its other instances' record runs past it (or never will tell: an instance whose
        steps are not priced; or was forgotten)."""
        machine = self.machine.get(instance)
        if machine is None or moment <= self._forgotten.get(machine, float("-inf")):
            return True
        for other, where in self.machine.items():
            if where != machine or other == instance:
                continue
            spans = self._spans.get(other)
            if self._counted.get(other, 0) < 0 and not spans:
                continue  # heartbeats that count no steps, no priced step: never tells
            told = max(spans[-1][1] if spans else float("-inf"),
                       self._idle_until.get(other, float("-inf")))
            if told < moment <= self._heard.get(other, float("inf")) + self.GONE_S:
                return False
        return True

    def held(self) -> int:
        """How many spans the record holds."""
        return sum(len(spans) for spans in self._spans.values())

    def heard(self, instance: str, at: float, steps: int, busy_since: float = -1.0) -> None:
        """A heartbeat of `instance` at `at` that counted `steps` steps so far and says since
        when a step of it has been running (0: none; -1: not said). Where every step it
        counted is in the record, it ran none from its last one's end until then (until
        `at` if none runs; not said: until 1.5x its longest step before `at`, which a step
        may still be running for). Instances not heard of for `FORGET_S` are forgotten."""
        if at <= 0:  # not a heartbeat of the step loop's (a draining worker's last word)
            return
        self._heard[instance] = at
        self._counted[instance] = steps
        if steps == self._last.get(instance, (0, 0.0))[0]:
            if busy_since < 0:
                until = at - 1.5 * self._longest.get(instance, self.FIRST_STEP_S)
            else:
                until = min(at, busy_since) if busy_since > 0 else at
            self._idle_until[instance] = max(self._idle_until.get(instance, float("-inf")),
                                             until)
            if steps == 0:  # it never ran a step before
                self._idle_before[instance] = until
        for gone in [i for i, t in self._heard.items() if t < at - self.FORGET_S]:
            self.forget(gone)

    def counted(self, instance: str) -> int:
        """The steps `instance`'s last heartbeat counted (-1: none heard)."""
        return self._counted.get(instance, -1)

    def complete(self, instance: str, end: float) -> None:
        """Every step `instance` ran until `end` is in the record (a benchmark's run,
        recorded whole): it was idle wherever no step of it ran."""
        self._idle_before[instance] = self._first.get(instance, end)
        self._idle_until[instance] = end

    def forget(self, instance: str) -> None:
        """Drop `instance`'s record: what its machine ran up to the last moment it told of
        is not known any more (its steps may have run beside the others')."""
        if instance in self.machine:
            told = max(self._last.get(instance, (0, 0.0))[1], self._heard.get(instance, 0.0),
                       self._idle_until.get(instance, 0.0))
            machine = self.machine[instance]
            self._forgotten[machine] = max(self._forgotten.get(machine, 0.0), told)
        for kept in (self.machine, self._spans, self._last, self._longest,
                     self._idle_until, self._idle_before, self._heard, self._counted,
                     self._first):
            kept.pop(instance, None)

    def running(self, instance: str, moment: float) -> Phase | Literal["idle"] | None:
        """What `instance` ran at `moment`: a step of a phase, nothing, or None (not known)."""
        if moment > self._heard.get(instance, float("inf")) + self.GONE_S:
            return "idle"  # stopped heartbeating: gone
        spans = self._spans[instance]
        if not spans or moment > spans[-1][1]:
            return "idle" if moment <= self._idle_until.get(instance, float("-inf")) else None
        if moment < spans[0][0]:
            return "idle" if moment <= self._idle_before.get(instance, float("-inf")) else None
        i = bisect.bisect_right(spans, moment, key=lambda span: span[0]) - 1
        return spans[i][2] if spans[i][1] >= moment else "idle"

    def beside(self, instance: str, moment: float) -> list[Phase] | None:
        """The phases of the steps the other instances of `instance`'s machine were running
        at `moment`; None where what one of them ran then is not known (or what `instance`
        itself ran: forgotten)."""
        if instance not in self.machine:
            return None
        machine, out = self.machine[instance], []
        if moment <= self._forgotten.get(machine, float("-inf")):
            return None
        for other, where in self.machine.items():
            if other == instance or where != machine:
                continue
            phase = self.running(other, moment)
            if phase is None:
                return None
            if phase != "idle":
                out.append(phase)
        return out


def phase_of(step: StepSample) -> Phase:
    """A step that computes prompt tokens is a prefill step, with decodes riding along or
    not (as the simulator runs a chunked step: it reads the weights anyway)."""
    return "prefill" if step.prompts else "decode"
