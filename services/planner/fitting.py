"""Least-squares fit of the latency model to profiled points, minimising relative error
(each row scaled by 1/measured) with non-negative coefficients."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

from services.planner.latency import PhaseCoefficients, Triple


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


def split_held_out(points: Sequence[Point], every: int = 4) -> tuple[list[Point], list[Point]]:
    """(fit set, held-out set): every `every`-th point is held out."""
    held = [p for i, p in enumerate(points) if i % every == every - 1]
    kept = [p for i, p in enumerate(points) if i % every != every - 1]
    return kept, held


def fit_phase(prefill: Sequence[PrefillPoint],
              decode: Sequence[DecodePoint]) -> tuple[PhaseCoefficients, dict[str, float]]:
    """Coefficients from all points, plus the median/max relative error on held-out points
    of a fit made without them."""
    report: dict[str, float] = {}
    for name, points in (("prefill", prefill), ("decode", decode)):
        kept, held = split_held_out(points)
        errors = relative_errors(fit(kept), held)
        report[f"{name}_heldout_median_rel_err"] = float(np.median(errors))
        report[f"{name}_heldout_max_rel_err"] = float(np.max(errors))
        report[f"{name}_points"] = float(len(points))
    decode_coef = fit(decode)
    return PhaseCoefficients(fit(prefill), decode_coef, decode_coef), report
