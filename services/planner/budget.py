"""Online planning on a fixed device budget (pure): which shape (tensor-parallel ranks) each
phase's instances take and how many of each, within `budget` devices, for the workload seen
recently.

Each phase's per-instance goodput comes from the simulator for every shape the planner may
run (simu_prefill: TTFT attainment of one prefill instance; simu_decode: TPOT attainment of
one decode instance, as in Algorithm 1); the split maximises the cluster's goodput,
min(n_p x prefill, n_d x decode), with at least one instance per phase. A phase that meets
its objective at no rate is sized by its raw capacity instead, so the plan still leans the
right way."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.planner.placement import (
    Problem,
    decode_bound,
    decode_goodput,
    prefill_bound,
    prefill_goodput,
)


@dataclass(frozen=True)
class Shape:
    """An instance's parallelism: `pp` pipeline stages of `tp` ranks, a device each."""

    tp: int = 1
    pp: int = 1

    @property
    def devices(self) -> int:
        return self.tp * self.pp

    def __str__(self) -> str:
        """'tp2', 'tp2 pp2' (pp only where several)."""
        return f"tp{self.tp}" + (f" pp{self.pp}" if self.pp > 1 else "")

    def label(self, role: str) -> str:
        """'prefill' for one device, else 'prefill tp2': a role's instances, named."""
        return role if self == ONE else f"{role} {self}"


ONE = Shape()


def searched_shapes(problem: Problem, budget: int) -> tuple[Shape, ...]:
    """The shapes the online planner weighs for an instance: every tensor-parallel degree,
    and every pipeline, the profile measured that fits the budget and holds the workload's
    longest request in its KV memory. Pipelines only where measured (`distserve profile
    --pp`): the paper's model prices a pp decode step as the whole batch's time / pp, while
    the engine runs it as pp micro-batches of its share of the batch, each stage reading its
    weights once a micro-batch (on the 2-vCPU Zen 4, pp 2 at batch 32: a 106.8 ms round
    against that model's 66.5), so a pipeline planned on it would serve less than planned.
    The profile's smallest tp where none fits (the plan then says what it can)."""
    profile = problem.profile
    shapes = [*(Shape(tp) for tp in profile.tps), *(Shape(tp, pp) for tp, pp
                                                   in sorted(profile.pipelines))]
    fitting = tuple(s for s in shapes if s.devices <= budget and problem.fits(s.tp, s.pp))
    return fitting or (Shape(profile.tps[0]),)


@dataclass(frozen=True)
class Option:
    """An instance shape a phase may take, and what one instance of it serves."""

    shape: Shape
    rps: float  # one instance's goodput (or capacity)


@dataclass(frozen=True)
class Split:
    prefill: Option
    n_prefill: int
    decode: Option
    n_decode: int


@dataclass(frozen=True)
class BudgetPlan:
    prefill: int
    decode: int
    prefill_goodput_rps: float  # per instance
    decode_goodput_rps: float
    goodput_rps: float  # the cluster's: the slower phase's total
    by_capacity: bool = False  # the objectives could not be met: split by raw capacity
    prefill_shape: Shape = ONE
    decode_shape: Shape = ONE


def split(budget: int, prefill: Sequence[Option], decode: Sequence[Option]) -> Split | None:
    """Each phase's shape and instance count within `budget` devices, at least one instance
    per phase, with the largest min(n_p x prefill rps, n_d x decode rps); ties go to the
    split that uses more devices, then to the phases' devices closer to even, then to the
    earlier options. With one-device shapes only, n_p + n_d = budget. None where no prefill
    and decode instance fit together."""
    found = []
    for p in prefill:
        for d in decode:
            for n_p in range(1, (budget - d.shape.devices) // p.shape.devices + 1):
                n_d = (budget - n_p * p.shape.devices) // d.shape.devices
                used_p, used_d = n_p * p.shape.devices, n_d * d.shape.devices
                found.append(((min(n_p * p.rps, n_d * d.rps), used_p + used_d,
                               -abs(used_p - used_d)), Split(p, n_p, d, n_d)))
    return max(found, key=lambda f: f[0])[1] if found else None


def plan_within_budget(problem: Problem, budget: int,
                       prefill_shapes: Sequence[Shape] = (ONE,),
                       decode_shapes: Sequence[Shape] = (ONE,)) -> BudgetPlan | None:
    """The best split of `budget` devices among prefill instances of one of
    `prefill_shapes` and decode instances of one of `decode_shapes`; None where no prefill
    and decode instance fit in the budget together."""
    if not any(p.devices + d.devices <= budget for p in prefill_shapes for d in decode_shapes):
        return None

    def options(goodput: Callable[[Problem, int, int], float],
                shapes: Sequence[Shape]) -> list[Option]:
        return [Option(s, goodput(problem, s.tp, s.pp)) for s in shapes if s.devices < budget]

    gp, gd = options(prefill_goodput, prefill_shapes), options(decode_goodput, decode_shapes)
    by_capacity = all(o.rps <= 0 for o in gp) or all(o.rps <= 0 for o in gd)
    if by_capacity:
        gp, gd = options(prefill_bound, prefill_shapes), options(decode_bound, decode_shapes)
    best = split(budget, gp, gd)
    assert best is not None  # a prefill and a decode shape fit together
    p, d = best.prefill, best.decode
    return BudgetPlan(best.n_prefill, best.n_decode, p.rps, d.rps,
                      min(best.n_prefill * p.rps, best.n_decode * d.rps), by_capacity,
                      p.shape, d.shape)
