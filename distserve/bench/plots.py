"""The benchmark's figures as PNG files (the paper's Fig. 8 rows and Fig. 10)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from distserve.bench.results import STAGES, RunResult, attainment_at_scales
from shared.metrics import SLO

SCALES = tuple(float(s) for s in np.round(np.arange(0.2, 3.01, 0.1), 2))


@dataclass(frozen=True)
class Curve:
    name: str
    devices: int
    runs: Sequence[RunResult]
    simulated: Sequence[float] | None = None  # simulated attainment at the same rates
    simulated_raw: Sequence[float] | None = None  # ... with the profile as fitted


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_attainment_vs_rate(curves: Sequence[Curve], slo: SLO, target: float, path: Path,
                            title: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for i, c in enumerate(curves):
        x = [r.rate / c.devices for r in c.runs]
        color = f"C{i}"
        ax.plot(x, [100 * r.attainment(slo) for r in c.runs], marker="o", color=color,
                label=f"{c.name} (measured)")
        if c.simulated is not None:
            ax.plot(x, [100 * a for a in c.simulated], linestyle=":", marker="x", color=color,
                    label=f"{c.name} (simulated)")
    ax.axhline(100 * target, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("rate per device (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(-3, 103)
    ax.set_title(f"{title}\nTTFT {slo.ttft_s:.3g} s, TPOT {slo.tpot_s:.3g} s", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_attainment_vs_scale(curves: Sequence[Curve], rate_index: int, slo: SLO,
                             target: float, path: Path, title: str) -> None:
    """Attainment as the SLOs are scaled (both by the same factor) at one rate."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for c in curves:
        run = c.runs[min(rate_index, len(c.runs) - 1)]
        ax.plot(SCALES, [100 * a for a in attainment_at_scales(run.records, slo, SCALES)],
                marker=".", label=f"{c.name} at {run.rate:g} req/s")
    ax.axhline(100 * target, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("SLO scale (x TTFT and TPOT objectives)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(-3, 103)
    ax.invert_xaxis()  # tighter to the right, as the paper draws it
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_breakdown(curves: Sequence[Curve], path: Path, title: str) -> bool:
    """Stacked mean time per stage at each rate; False (nothing written) without traces."""
    bars = [(f"{c.name}\n{r.rate:g}/s", r.breakdown_s) for c in curves for r in c.runs
            if r.breakdown_s]
    if not bars:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.5, 0.7 * len(bars)), 4.2))
    bottom = np.zeros(len(bars))
    for i, stage in enumerate(STAGES):
        heights = np.array([b.get(stage, 0.0) for _, b in bars])
        ax.bar(range(len(bars)), heights, bottom=bottom, label=stage, color=f"C{i}")
        bottom += heights
    ax.set_xticks(range(len(bars)), [label for label, _ in bars], fontsize=7)
    ax.set_ylabel("mean seconds per request")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
