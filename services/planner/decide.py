"""The online planner's decision, pure: a replan request (its reasons, the recent workload)
and what the planner is configured with in; the split of the device budget and the record
of why out. No clock, no I/O: the service (services/planner/service.py) hands it the time
and applies the plan, and a plan history recorded by a live planner replays through it
(tests/services/test_replanning.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from services.planner.budget import Shape
from services.planner.calibration import Calibration
from services.planner.modes import (
    MODES,
    SWITCH_MARGIN,
    Candidate,
    Kind,
    Mode,
    best,
    candidates,
    role_of,
    worth_switching,
)
from services.planner.placement import Problem
from services.planner.profiles import Profile, with_prefill_of
from shared.messages import ReplanRequest, WorkloadSummary
from shared.metrics import SLO
from shared.state import Role
from shared.workloads import Lengths, Workload


@dataclass(frozen=True)
class PlannerConfig:
    profile: Profile
    slo: SLO
    attainment: float  # the share of requests that must meet both objectives
    budget: int  # devices
    modes: tuple[Mode, ...] = MODES  # what the deployer may run; all are weighed
    switch_margin: float = SWITCH_MARGIN  # another mode's goodput must be this much higher
    batch_tokens: int = 0  # the workers' prompt tokens per step (0: the profile's L_m)
    max_running: int = 0  # the workers' running requests at most (0: the profile's)
    # roles whose workers' shape `up` fixed; the others' tp is searched (budget.searched_shapes)
    fixed: Mapping[Role, Shape] = field(default_factory=dict)
    # measured in the prefill workers' dtype where it is not `profile`'s (DS_PREFILL_DTYPE):
    # the disaggregated mode's prefill instances are priced with it
    prefill_profile: Profile | None = None

    def profile_of(self, mode: Mode) -> Profile:
        """What `mode`'s instances are priced with: a colocated worker runs one dtype for
        both phases (`profile`'s); a disaggregated prefill instance its own."""
        if mode == "disaggregated" and self.prefill_profile is not None:
            return with_prefill_of(self.profile, self.prefill_profile)
        return self.profile


@dataclass(frozen=True)
class Decision:
    workload: WorkloadSummary  # planned for: the request's, or the last one seen
    plan: Candidate  # the best mode the deployer can run
    candidates: list[Candidate]  # every mode weighed
    record: dict[str, Any]  # what the planner stores in its history (JSON-ready)

    @property
    def target(self) -> dict[Kind, int]:
        return self.plan.deployment


def problem_for(workload: WorkloadSummary, config: PlannerConfig, calibration: Calibration,
                mode: Mode = "colocated") -> Problem:
    """`mode`'s search on the calibrated profile its instances are priced with. The
    calibration is each phase's measured steps over the profile of the workers that ran
    them (services/profiler), so it moves a dtype's price by what the stack measured in
    another."""
    prompts = np.array(workload.prompt_tokens)
    cached = np.array(workload.cached_tokens) if len(workload.cached_tokens) == len(prompts) \
        else None  # (a summary without them: every prompt computed whole)
    lengths = Lengths(prompts, np.array(workload.output_tokens),
                      None if cached is None else np.minimum(cached, prompts - 1))
    cv = workload.arrival_cv if workload.arrival_cv > 0 else 1.0
    return Problem(calibration.apply(config.profile_of(mode)), Workload(lengths, cv=cv),
                   config.slo,
                   max(workload.rate_rps, 1e-3), 1, config.budget, config.attainment, workers=1,
                   batch_tokens=config.batch_tokens, max_batch=config.max_running)


def decide(request: ReplanRequest, last_workload: WorkloadSummary | None,
           config: PlannerConfig, now: float, calibration: Calibration | None = None,
           current: Mode | None = None,
           current_shapes: Mapping[Kind, Shape] | None = None) -> Decision | None:
    """The plan for the request's workload (a request without one, e.g. the timer's, plans
    for `last_workload` again) on the profile as calibrated on the running stack (as
    profiled when None); None before any workload was seen. The best mode the deployer may
    run wins, but the `current` one (what the live workers serve in) stays unless the other
    is `switch_margin` better; so do the live workers' shapes (`current_shapes`, by kind)
    unless another shape of the same mode is as much better, since reshaping a role
    restarts its workers too. `now` stamps the record; the record's `inputs`,
    `calibration`, `current_mode` and `current_shapes` hold the rest, so the decision can
    be made again."""
    workload = request.workload or last_workload
    if workload is None:
        return None
    calibration = calibration or Calibration()
    problems = {mode: problem_for(workload, config, calibration, mode) for mode in MODES}
    found = [c for mode in MODES
             for c in candidates(problems[mode], config.budget, (mode,), config.fixed)]
    deployable = [c for c in found if c.mode in config.modes]
    if not deployable:
        raise ValueError(f"no {'/'.join(config.modes)} plan fits a budget of {config.budget} "
                         "device(s) (disaggregated serving needs two)")
    plan = best(deployable)
    stay = next((c for c in deployable if c.mode == current), None)
    if stay is not None and current_shapes:
        stay = as_live(stay, current_shapes, problems[stay.mode], config)
    if stay is not None and not worth_switching(plan, stay, config.switch_margin):
        plan = stay
    record: dict[str, Any] = {
        "made_at": now, "reasons": list(request.reasons), "budget": config.budget,
        "slo": asdict(config.slo), **asdict(plan),
        "best_mode": best(found).mode, "current_mode": current,
        "current_shapes": {kind: asdict(shape) for kind, shape in (current_shapes or {}).items()},
        "deployable": list(config.modes), "switch_margin": config.switch_margin,
        "fixed": {role: asdict(shape) for role, shape in config.fixed.items()},
        "prefill_dtype": config.prefill_profile.dtype if config.prefill_profile else "",
        "candidates": [asdict(c) for c in found],
        "workload": {"rate_rps": workload.rate_rps, "arrival_cv": workload.arrival_cv,
                     "requests": len(workload.prompt_tokens),
                     "prompt_mean": float(np.mean(workload.prompt_tokens)),
                     "output_mean": float(np.mean(workload.output_tokens)),
                     "cached_mean": float(np.mean(workload.cached_tokens or [0]))},
        "inputs": workload.model_dump(), "calibration": calibration.model_dump()}
    return Decision(workload, plan, found, record)


def as_live(candidate: Candidate, live: Mapping[Kind, Shape], problem: Problem,
            config: PlannerConfig) -> Candidate | None:
    """`candidate`'s mode in the shapes its workers have now (`live`, by kind): itself where
    they are its shapes, else that mode searched again with those shapes fixed (None where
    they do not fit the budget, the profile lacks their tp, or the mode's workers are not
    all live). Roles `up` fixed are priced as `config.fixed` says, whatever their workers
    report: the deployer never reshapes them."""
    kinds = [k for k, n in candidate.deployment.items() if n]
    if any(k not in live for k in kinds):
        return None
    free = [k for k in kinds if role_of(k) not in config.fixed]
    if all(candidate.shapes[k] == live[k] for k in free):
        return candidate
    if any(live[k].tp not in problem.profile.tps for k in free):
        return None
    fixed = {**{role_of(k): live[k] for k in free}, **config.fixed}
    found = candidates(problem, config.budget, (candidate.mode,), fixed)
    return found[0] if found else None
