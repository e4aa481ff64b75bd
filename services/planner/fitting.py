"""Least-squares fit of the latency model to profiled points, minimising relative error
(each row scaled by 1/measured) with non-negative coefficients."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from scipy.optimize import nnls

from services.planner.latency import LatencyModel, PhaseCoefficients, Triple, chunk_terms


@dataclass(frozen=True)
class PrefillPoint:
    lengths: tuple[int, ...]  # prompt lengths batched together
    ms: float

    @property
    def features(self) -> list[float]:
        return [1.0, float(sum(self.lengths)), float(sum(n * n for n in self.lengths))]


@dataclass(frozen=True)
class DecodePoint:
    batch: int
    sum_ctx: int
    ms: float

    @property
    def features(self) -> list[float]:
        return [1.0, float(self.sum_ctx), float(self.batch)]


@dataclass(frozen=True)
class CachedPoint:
    """A step computing the last `length` tokens of a prompt whose first `cached` tokens an
    earlier step computed (`ms`), and a whole prompt of `length` in a step (`whole_ms`)."""

    length: int
    cached: int
    ms: float
    whole_ms: float

    @property
    def pairs(self) -> float:
        """New tokens times cached ones: what attention to the cached keys grows with."""
        return float(self.length * self.cached)


Point = PrefillPoint | DecodePoint


def fit(points: Sequence[Point]) -> Triple:
    x = np.array([p.features for p in points])
    y = np.array([p.ms for p in points])
    coef, _ = nnls(x / y[:, None], np.ones_like(y))
    return (float(coef[0]), float(coef[1]), float(coef[2]))


def predict(coef: Triple, point: Point) -> float:
    return float(np.dot(coef, point.features))


def relative_errors(coef: Triple, points: Sequence[Point]) -> list[float]:
    return [abs(predict(coef, p) - p.ms) / p.ms for p in points]


P = TypeVar("P", PrefillPoint, DecodePoint)


def interior_held_out(points: Sequence[P], size: Callable[[P], float]
                      ) -> tuple[list[P], list[P]]:
    """(fit set, held-out set): every other point strictly inside the profiled range is held
    out; the smallest and largest sizes always stay in the fit, because the model is used to
    interpolate within the range it was profiled over, not to extrapolate beyond it."""
    lo, hi = min(map(size, points)), max(map(size, points))
    inside = [p for p in points if lo < size(p) < hi]
    held = inside[1::2]
    return [p for p in points if p not in held], held


def _fit_regimes(small: Sequence[DecodePoint], large: Sequence[DecodePoint]
                 ) -> tuple[Triple, Triple]:
    """Both regimes in one fit sharing the cost per context token: the regimes differ in
    how the GEMMs run (the constant, the cost per request), while attention reads each
    cached token the same way at any batch size. Fitted apart, a regime's few small
    batches put their context cost into the other terms (on one profile the small-batch
    cost per token came out 0, under-pricing a batch of two at 512 tokens by 11%)."""
    rows = [[1.0, float(p.batch), 0.0, 0.0, float(p.sum_ctx)] for p in small] + \
        [[0.0, 0.0, 1.0, float(p.batch), float(p.sum_ctx)] for p in large]
    y = np.array([p.ms for p in [*small, *large]])
    coef, _ = nnls(np.array(rows) / y[:, None], np.ones_like(y))
    a_s, c_s, a_l, c_l, per_ctx = map(float, coef)
    return (a_s, per_ctx, c_s), (a_l, per_ctx, c_l)


def fit_decode(points: Sequence[DecodePoint]) -> tuple[Triple, Triple, int]:
    """(small-batch triple, large-batch triple, threshold): the split of batch sizes into two
    regimes (memory-bound, compute-bound GEMMs) with the smallest total relative error;
    one regime when no split helps."""
    single = fit(points)
    best = (sum(e * e for e in relative_errors(single, points)), single, single, 1 << 30)
    for threshold in sorted({p.batch for p in points}):
        small = [p for p in points if p.batch < threshold]
        large = [p for p in points if p.batch >= threshold]
        if len(small) < 3 or len(large) < 3:
            continue
        cs, cl = _fit_regimes(small, large)
        err = sum(e * e for e in relative_errors(cs, small) + relative_errors(cl, large))
        if err < best[0]:
            best = (err, cs, cl, threshold)
    return best[1], best[2], best[3]


def _decode_prediction(kept: Sequence[DecodePoint], point: DecodePoint) -> float:
    small, large, threshold = fit_decode(kept)
    return predict(small if point.batch < threshold else large, point)


def fit_phase(prefill: Sequence[PrefillPoint],
              decode: Sequence[DecodePoint]) -> tuple[PhaseCoefficients, dict[str, float]]:
    """Coefficients from all points, plus the median/max relative error on interior points
    held out of a second fit."""
    kept_p, held_p = interior_held_out(prefill, lambda p: sum(p.lengths))
    kept_d, held_d = interior_held_out(decode, lambda p: p.batch)
    report: dict[str, float] = {}
    for name, errors in (
            ("prefill", relative_errors(fit(kept_p), held_p)),
            ("decode", [abs(_decode_prediction(kept_d, p) - p.ms) / p.ms for p in held_d])):
        report[f"{name}_heldout_median_rel_err"] = float(np.median(errors))
        report[f"{name}_heldout_max_rel_err"] = float(np.max(errors))
        report[f"{name}_heldout_points"] = float(len(errors))
    report["prefill_points"], report["decode_points"] = float(len(prefill)), float(len(decode))
    small, large, threshold = fit_decode(decode)
    return PhaseCoefficients(fit(prefill), small, large, threshold), report


def fit_cached(points: Sequence[CachedPoint]) -> float | None:
    """d of the latency model (`PhaseCoefficients.prefill_cached`): ms per new token and
    token cached before it, fitted on what each chunk took beyond a whole prompt of its
    length (so the whole-prompt fit's own error at that length stays out of it), through the
    origin, minimising relative error. None where it comes out at 0 or below (chunks no
    slower than whole prompts: noise, not free attention; the model then prices them at c)."""
    x = np.array([p.pairs for p in points])
    y = np.array([p.ms - p.whole_ms for p in points])
    w = 1.0 / np.array([p.ms for p in points]) ** 2
    d = float((w * x * y).sum() / (w * x * x).sum())
    return d if d > 0 else None


def cached_report(co: PhaseCoefficients, points: Sequence[CachedPoint]) -> dict[str, float]:
    """How the whole model (a, b, c and d) prices the chunks measured: their median and
    largest relative error, and the same for pricing them as before d was measured (their
    cached tokens at the quadratic term c)."""
    def errors(model: LatencyModel) -> list[float]:
        return [abs(model.prefill_ms(*chunk_terms([(p.length, p.cached)])) - p.ms) / p.ms
                for p in points]
    with_d = errors(LatencyModel(co))
    at_c = errors(LatencyModel(dataclasses.replace(co, prefill_cached=None)))
    return {"prefill_cached_points": float(len(points)),
            "prefill_cached_median_rel_err": float(np.median(with_d)),
            "prefill_cached_max_rel_err": float(np.max(with_d)),
            "prefill_cached_at_c_median_rel_err": float(np.median(at_c)),
            "prefill_cached_at_c_max_rel_err": float(np.max(at_c))}
