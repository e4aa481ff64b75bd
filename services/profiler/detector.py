"""Workload shift detection (DistServe §4.3 "Replanning"), pure: windows of finished
requests in, a verdict out.

The reference window is the workload the current plan was made for; the recent window is the
last `window` requests. A shift is a significant and large change of
- the prompt or output length distribution: two-sample Kolmogorov-Smirnov test, p < alpha and
  statistic >= min_ks (an effect size, so a huge window does not flag a trifle);
- the arrival rate: conditional binomial test on the two windows' counts over their spans
  (equal Poisson rates give n_recent ~ Binomial(n, T_recent / (T_ref + T_recent))),
  p < alpha and a ratio of at least min_rate_ratio either way.
After a shift the window is refilled, and the first window made only of requests after the
shift becomes the new reference (the window that flagged the shift is a mix of both
workloads); nothing is flagged before that, nor for `cooldown_s` (no flapping while the new
plan is applied).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy import stats


@dataclass(frozen=True)
class RequestEvent:
    """A finished request, as the gateway publishes it."""

    arrival_s: float  # wall clock
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0  # of the prompt, found in a prefix cache


@dataclass(frozen=True)
class DetectorConfig:
    window: int = 60  # requests in the recent window (and the least in the reference)
    alpha: float = 1e-3
    min_ks: float = 0.3
    min_rate_ratio: float = 2.0
    cooldown_s: float = 30.0
    check_every: int = 5  # requests between tests


@dataclass(frozen=True)
class WindowStats:
    requests: int
    rate_rps: float
    arrival_cv: float
    prompt_mean: float
    prompt_p50: float
    prompt_p90: float
    output_mean: float
    output_p50: float
    output_p90: float

    @staticmethod
    def of(events: Sequence[RequestEvent]) -> WindowStats:
        times = np.sort([e.arrival_s for e in events])
        gaps = np.diff(times)
        prompts = np.array([e.prompt_tokens for e in events], dtype=float)
        outputs = np.array([e.output_tokens for e in events], dtype=float)
        p50, p90 = (float(x) for x in np.percentile(prompts, [50, 90]))
        o50, o90 = (float(x) for x in np.percentile(outputs, [50, 90]))
        return WindowStats(
            len(events), rate(events),
            float(gaps.std() / gaps.mean()) if len(gaps) > 1 and gaps.mean() > 0 else 0.0,
            float(prompts.mean()), p50, p90, float(outputs.mean()), o50, o90)


@dataclass(frozen=True)
class Shift:
    reasons: tuple[str, ...]
    reference: WindowStats
    recent: WindowStats


def span(events: Sequence[RequestEvent]) -> float:
    """Seconds covered by the window: n arrivals span about n gaps."""
    times = [e.arrival_s for e in events]
    n = len(times)
    return (max(times) - min(times)) * n / (n - 1) if n > 1 else 0.0


def rate(events: Sequence[RequestEvent]) -> float:
    s = span(events)
    return len(events) / s if s > 0 else 0.0


def detect(reference: Sequence[RequestEvent], recent: Sequence[RequestEvent],
           config: DetectorConfig) -> tuple[str, ...]:
    """The reasons `recent` differs significantly from `reference` (empty: no shift)."""
    reasons = []
    for name, attr in (("prompt", "prompt_tokens"), ("output", "output_tokens")):
        a = [getattr(e, attr) for e in reference]
        b = [getattr(e, attr) for e in recent]
        test = stats.ks_2samp(a, b, method="asymp")
        if test.pvalue < config.alpha and test.statistic >= config.min_ks:
            reasons.append(f"{name} lengths changed (KS {test.statistic:.2f}, p {test.pvalue:.1e}"
                           f", median {np.median(a):.0f} -> {np.median(b):.0f})")
    t_ref, t_new = span(reference), span(recent)
    if t_ref > 0 and t_new > 0:
        n_ref, n_new = len(reference), len(recent)
        ratio = (n_new / t_new) / (n_ref / t_ref)
        p = stats.binomtest(n_new, n_ref + n_new, t_new / (t_ref + t_new)).pvalue
        if p < config.alpha and max(ratio, 1 / ratio) >= config.min_rate_ratio:
            reasons.append(f"arrival rate changed {ratio:.1f}x ({n_ref / t_ref:.2f} -> "
                           f"{n_new / t_new:.2f} req/s, p {p:.1e})")
    return tuple(reasons)


@dataclass
class WorkloadMonitor:
    """Sliding windows over finished requests; `observe` returns a Shift when one is found.
    The first full window becomes the reference (reported as a shift from nothing, so the
    planner can plan for the workload actually seen)."""

    config: DetectorConfig = field(default_factory=DetectorConfig)
    reference: list[RequestEvent] = field(default_factory=list)
    recent: deque[RequestEvent] = field(init=False)
    last_shift_s: float = -float("inf")
    settling: bool = False  # after a shift, until a window of only new requests is in
    seen: int = 0

    def __post_init__(self) -> None:
        self.recent = deque(maxlen=self.config.window)

    def observe(self, event: RequestEvent, now_s: float) -> Shift | None:
        self.recent.append(event)
        self.seen += 1
        if len(self.recent) < self.config.window:
            return None
        if not self.reference:
            return self._shift(("first full window",), now_s)
        if self.settling:
            self.reference, self.settling = list(self.recent), False
            return None
        if now_s - self.last_shift_s < self.config.cooldown_s or \
                self.seen % self.config.check_every:
            return None
        reasons = detect(self.reference, list(self.recent), self.config)
        return self._shift(reasons, now_s) if reasons else None

    def _shift(self, reasons: tuple[str, ...], now_s: float) -> Shift:
        recent = list(self.recent)
        shift = Shift(reasons, WindowStats.of(self.reference or recent), WindowStats.of(recent))
        self.settling = bool(self.reference)
        self.reference = recent
        self.recent.clear()
        self.last_shift_s = now_s
        return shift
