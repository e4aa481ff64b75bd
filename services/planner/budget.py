"""Online planning on a fixed device budget (pure): how to split `budget` single-device
instances between prefill and decode for the workload seen recently.

Each phase's per-instance goodput comes from the simulator (simu_prefill: TTFT attainment of
one prefill instance; simu_decode: TPOT attainment of one decode instance, as in
Algorithm 1); the split maximises the cluster's goodput, min(n_p x prefill, n_d x decode),
with at least one instance per phase. A phase that meets its objective at no rate is sized by
its raw capacity instead, so the plan still leans the right way."""

from __future__ import annotations

from dataclasses import dataclass

from services.planner.placement import (
    Problem,
    decode_bound,
    decode_goodput,
    prefill_bound,
    prefill_goodput,
)


@dataclass(frozen=True)
class BudgetPlan:
    prefill: int
    decode: int
    prefill_goodput_rps: float  # per instance
    decode_goodput_rps: float
    goodput_rps: float  # the cluster's: the slower phase's total
    by_capacity: bool = False  # the objectives could not be met: split by raw capacity


def split(budget: int, prefill_rps: float, decode_rps: float) -> tuple[int, int]:
    """The (n_p, n_d), n_p + n_d = budget, each >= 1, with the largest min(n_p x prefill_rps,
    n_d x decode_rps); ties go to the split closer to even."""
    if budget < 2:
        raise ValueError(f"a disaggregated plan needs at least 2 devices, got {budget}")
    return max(((n, budget - n) for n in range(1, budget)),
               key=lambda s: (min(s[0] * prefill_rps, s[1] * decode_rps), -abs(s[0] - s[1])))


def plan_within_budget(problem: Problem, budget: int) -> BudgetPlan:
    gp, gd = prefill_goodput(problem, 1, 1), decode_goodput(problem, 1, 1)
    by_capacity = gp <= 0 or gd <= 0
    if by_capacity:
        gp, gd = prefill_bound(problem, 1, 1), decode_bound(problem, 1, 1)
    n_p, n_d = split(budget, gp, gd)
    return BudgetPlan(n_p, n_d, gp, gd, min(n_p * gp, n_d * gd), by_capacity)
