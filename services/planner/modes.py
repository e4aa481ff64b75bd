"""Which serving mode a workload should run in, on a budget of devices (pure):
disaggregated prefill and decode (the best n_p : n_d split), colocated replicas (a prefill
step whenever prompts can be admitted, vLLM's default), or colocated replicas with chunked
prefill, each role's instances in the tensor-parallel shape that serves most
(budget.searched_shapes). Each candidate is the budget simulated as one cluster (devices no
whole instance fits left idle), on the same requests and objectives; the highest goodput
wins.

Disaggregation wins where prefill steps would stall decodes past the TPOT objective (long
prompts, a tight TPOT); colocation wins where a prompt costs little next to a decode step
(short prompts, long outputs): every device then both prefills and decodes instead of
half of them waiting on the other half."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from services.planner.budget import ONE, Shape, plan_within_budget, searched_shapes
from services.planner.goodput import max_rate
from services.planner.placement import Problem, decode_bound, prefill_bound
from services.planner.simulator import (
    ColocatedCluster,
    DisaggregatedCluster,
    SimResult,
    simulate_colocated,
    simulate_disaggregated,
)
from shared.state import Role
from shared.workloads import WorkloadRequest

Mode = Literal["disaggregated", "colocated", "chunked"]
MODES: tuple[Mode, ...] = ("disaggregated", "colocated", "chunked")
SWITCH_MARGIN = 1.2  # another mode must serve this many times more to switch to it


def parse_modes(text: str) -> tuple[Mode, ...]:
    """'colocated, chunked' -> the modes, in `MODES` order; ValueError naming the rest."""
    named = {m.strip() for m in text.split(",") if m.strip()}
    if not named or named - set(MODES):
        unknown = ", ".join(sorted(named - set(MODES))) or "none given"
        raise ValueError(f"unknown modes: {unknown}; the modes are {', '.join(MODES)}")
    return tuple(m for m in MODES if m in named)


# what a deployer starts: a worker role, colocated workers with and without chunked prefill
Kind = Literal["prefill", "decode", "colocated", "chunked"]
KINDS: tuple[Kind, ...] = ("prefill", "decode", "colocated", "chunked")


def role_of(kind: Kind) -> Role:
    """The worker role a kind runs as (chunked: a colocated worker that chunks prompts)."""
    return "colocated" if kind == "chunked" else kind


@dataclass(frozen=True)
class Candidate:
    mode: Mode
    prefill: int  # instances of each role on the budget (0 where the mode has none)
    decode: int
    colocated: int
    goodput_rps: float  # the budget's, simulated as one cluster (0: no rate meets the target)
    attainment: float  # simulated at the problem's rate
    by_capacity: bool = False  # disaggregated: no split met the objectives, sized by capacity
    prefill_shape: Shape = ONE  # each role's instances' parallelism (a device a rank)
    decode_shape: Shape = ONE
    colocated_shape: Shape = ONE

    @property
    def devices(self) -> int:
        return (self.prefill * self.prefill_shape.devices + self.decode *
                self.decode_shape.devices + self.colocated * self.colocated_shape.devices)

    @property
    def per_device_rps(self) -> float:
        return self.goodput_rps / self.devices

    @property
    def deployment(self) -> dict[Kind, int]:
        """The workers of each kind this candidate runs."""
        return {"prefill": self.prefill, "decode": self.decode,
                "colocated": self.colocated if self.mode == "colocated" else 0,
                "chunked": self.colocated if self.mode == "chunked" else 0}

    @property
    def shapes(self) -> dict[Kind, Shape]:
        """The parallelism of the workers of each kind this candidate runs."""
        return {"prefill": self.prefill_shape, "decode": self.decode_shape,
                "colocated": self.colocated_shape, "chunked": self.colocated_shape}

    @property
    def layout(self) -> str:
        if self.mode == "disaggregated":
            return (f"{self.prefill} {self.prefill_shape.label('prefill')} + "
                    f"{self.decode} {self.decode_shape.label('decode')}")
        return (f"{self.colocated} {'chunked ' if self.mode == 'chunked' else ''}"
                f"{self.colocated_shape.label('colocated')}")


Simulate = Callable[[Sequence[WorkloadRequest]], SimResult]


def cluster(problem: Problem, mode: Mode, counts: tuple[int, int, int],
            shapes: tuple[Shape, Shape, Shape] = (ONE, ONE, ONE)) -> Simulate:
    """The simulation of `counts` = (prefill, decode, colocated) instances of `shapes`."""
    (n_p, n_d, n_c), (s_p, s_d, s_c) = counts, shapes
    if mode == "disaggregated":
        cluster = DisaggregatedCluster([problem.instance(s_p.tp, s_p.pp)] * n_p,
                                       [problem.instance(s_d.tp, s_d.pp)] * n_d, problem.link)
        return lambda w: simulate_disaggregated(cluster, w)
    colocated = ColocatedCluster([problem.instance(s_c.tp, s_c.pp)] * n_c,
                                 chunked=mode == "chunked")
    return lambda w: simulate_colocated(colocated, w)


def _candidate(problem: Problem, mode: Mode, counts: tuple[int, int, int], upper: float,
               shapes: tuple[Shape, Shape, Shape] = (ONE, ONE, ONE),
               by_capacity: bool = False) -> Candidate:
    simulate = cluster(problem, mode, counts, shapes)
    attained = problem.attainment_at(simulate, lambda r: r.attainment(problem.slo))
    goodput = max_rate(attained, problem.target, guess=max(upper / 4, 1e-3), upper=upper)
    return Candidate(mode, *counts, goodput_rps=goodput, attainment=attained(problem.rate),
                     by_capacity=by_capacity, prefill_shape=shapes[0], decode_shape=shapes[1],
                     colocated_shape=shapes[2])


def candidates(problem: Problem, budget: int, modes: Sequence[Mode] = MODES,
               fixed: Mapping[Role, Shape] | None = None) -> list[Candidate]:
    """Every mode on `budget` devices, in `modes` order (disaggregated needs two). Each
    role's instances take the shape `fixed` gives it, or the best of `searched_shapes`."""
    searched = searched_shapes(problem, budget)
    def shapes(role: Role) -> tuple[Shape, ...]:
        return (fixed[role],) if fixed and role in fixed else searched

    out = []
    for mode in modes:
        if mode == "disaggregated":
            split = plan_within_budget(problem, budget, shapes("prefill"), shapes("decode"))
            if split is None:  # fewer than two devices, or shapes too wide for the budget
                continue
            s_p, s_d = split.prefill_shape, split.decode_shape
            upper = min(split.prefill * prefill_bound(problem, s_p.tp, s_p.pp),
                        split.decode * decode_bound(problem, s_d.tp, s_d.pp))
            out.append(_candidate(problem, mode, (split.prefill, split.decode, 0), upper,
                                  (s_p, s_d, ONE), split.by_capacity))
        else:
            tried = [_colocated(problem, mode, budget, s) for s in shapes("colocated")
                     if s.devices <= budget]
            if tried:
                out.append(best(tried))
    return out


def _colocated(problem: Problem, mode: Mode, budget: int, shape: Shape) -> Candidate:
    """Colocated (or chunked) replicas of `shape`, as many as the budget holds."""
    n = budget // shape.devices
    upper = n * (colocated_bound(problem, shape) if mode == "colocated"
                 else chunked_bound(problem, shape))
    return _candidate(problem, mode, (0, 0, n), upper, (ONE, ONE, shape))


def colocated_bound(problem: Problem, shape: Shape = ONE) -> float:
    """Requests/s one colocated instance sustains at best: it spends each request's prefill
    and decode time itself."""
    return 1 / (1 / prefill_bound(problem, shape.tp, shape.pp)
                + 1 / decode_bound(problem, shape.tp, shape.pp))


def chunked_bound(problem: Problem, shape: Shape = ONE) -> float:
    """Requests/s one chunked-prefill instance sustains at best (an upper bound for the
    search): every step full, its token budget shared by prompt tokens and decodes (one
    token each) in the workload's proportion, each decode costing what it adds to a step at
    no context (`LatencyModel.riding_ms`), attention left out."""
    lengths, lat = problem.workload.lengths, problem.profile.latency(shape.tp, shape.pp)
    constant_ms, per_token_ms, _ = lat.coefficients.prefill
    prompt, decodes = lengths.mean_computed, max(1.0, lengths.mean_output - 1)
    per_step = problem.l_m / (prompt + decodes)  # requests' worth of tokens in a full step
    step_ms = constant_ms + per_step * (per_token_ms * prompt + lat.riding_ms(1, 0) * decodes)
    return per_step / (step_ms / lat.pp / 1e3)


def best(found: Sequence[Candidate]) -> Candidate:
    """The highest goodput; where none meets the objectives at any rate, the best attainment
    at the problem's rate. Ties go to the earlier candidate (`MODES` order)."""
    return max(found, key=lambda c: (c.goodput_rps, c.attainment if c.goodput_rps == 0 else 0))


def serving_mode(counts: dict[Kind, int]) -> Mode | None:
    """The mode live workers of each kind serve in: the one most of them serve (None when
    none are live; prefill or decode instances alone serve nothing)."""
    served: dict[Mode, int] = {
        "disaggregated": counts.get("prefill", 0) + counts.get("decode", 0)
        if counts.get("prefill", 0) and counts.get("decode", 0) else 0,
        "colocated": counts.get("colocated", 0), "chunked": counts.get("chunked", 0)}
    mode = max(MODES, key=lambda m: served[m])
    return mode if served[mode] else None


def worth_switching(to: Candidate, stay: Candidate, margin: float) -> bool:
    """Whether moving from `stay` to `to` pays for restarting the workers: a goodput
    `margin` times higher (where neither meets the objectives at any rate, an attainment
    `margin` times higher at the rate)."""
    if to.goodput_rps or stay.goodput_rps:
        return to.goodput_rps > margin * stay.goodput_rps
    return to.attainment > margin * stay.attainment
