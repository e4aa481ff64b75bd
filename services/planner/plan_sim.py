"""Simulate a plan: rebuild its cluster from the plan and the profile it was made with."""

from __future__ import annotations

import dataclasses

from services.planner.baseline import VLLM_MAX_NUM_BATCHED_TOKENS, VLLM_MAX_NUM_SEQS
from services.planner.budget import Shape
from services.planner.goodput import max_rate
from services.planner.modes import chunked_bound, colocated_bound
from services.planner.placement import (
    Problem,
    decode_bound,
    instance_spec,
    layout_cluster,
    prefill_bound,
)
from services.planner.plan import InstancePlacement, Plan
from services.planner.profiles import Profile
from services.planner.simulator import (
    ColocatedCluster,
    Link,
    SimResult,
    simulate_colocated,
    simulate_disaggregated,
)
from shared.workloads import WorkloadRequest


def simulate_plan(plan: Plan, profile: Profile,
                  workload: list[WorkloadRequest]) -> SimResult:
    if plan.algorithm == "colocated":
        specs = [dataclasses.replace(
            instance_spec(profile, i.tp, i.pp, i.devices[0][0]),
            max_batch_tokens=plan.max_batch_tokens or VLLM_MAX_NUM_BATCHED_TOKENS,
            max_batch=plan.max_running or VLLM_MAX_NUM_SEQS) for i in plan.instances]
        return simulate_colocated(ColocatedCluster(specs, plan.mode == "chunked",
                                                   plan.devices_used), workload)
    link = Link(profile.model.kv_bytes_per_token, plan.intra_node_gbps * 1e9,
                plan.inter_node_gbps * 1e9)
    return simulate_disaggregated(
        layout_cluster(profile, plan.instances, link, plan.devices_used), workload)


def served_rps(plan: Plan, problem: Problem) -> float:
    """The highest rate at which `plan`'s whole placement meets `problem`'s objectives for its
    target share of requests, simulated as one cluster (both objectives at once, the KV
    handoffs, the host's contention) on runs as long as `predicted_attainment`'s: what the
    placement serves, however its search priced it (Algorithm 1 prices each phase alone,
    against its own objective; the searches' short runs flatter a system near capacity)."""
    plan = linked(plan, problem)

    def at(rate: float) -> float:  # the long runs a finished plan is checked with
        requests = problem.validation_requests(rate)
        return simulate_plan(plan, problem.profile, requests).attainment(problem.slo)

    return max_rate(at, problem.target, guess=plan.rate_rps, upper=bound_rps(plan, problem))


def cached_share(plan: Plan, problem: Problem) -> float:
    """Of the prompt tokens of `problem`'s workload at its rate, the share `plan`'s
    instances find in their prefix caches (simulated, on a finished plan's long run)."""
    return simulate_plan(linked(plan, problem), problem.profile,
                         problem.validation_requests(problem.rate)).cached_share


def linked(plan: Plan, problem: Problem) -> Plan:
    """`plan` with `problem`'s KV links (a search's plan keeps the defaults)."""
    return plan.model_copy(update={"intra_node_gbps": problem.intra_node_gbps,
                                   "inter_node_gbps": problem.inter_node_gbps})


def bound_rps(plan: Plan, problem: Problem) -> float:
    """Requests/s `plan`'s instances sustain at best (each one's throughput bound, under the
    scheduler limits the plan records)."""
    if plan.algorithm == "colocated":
        problem = dataclasses.replace(
            problem, batch_tokens=plan.max_batch_tokens or VLLM_MAX_NUM_BATCHED_TOKENS,
            max_batch=plan.max_running or VLLM_MAX_NUM_SEQS)

    def bound(i: InstancePlacement) -> float:
        if plan.mode == "chunked":
            return chunked_bound(problem, Shape(i.tp, i.pp))
        if i.role == "colocated":
            return colocated_bound(problem, Shape(i.tp, i.pp))
        return (prefill_bound if i.role == "prefill" else decode_bound)(problem, i.tp, i.pp)

    if plan.mode != "disaggregated":
        return sum(bound(i) for i in plan.instances)
    return min(sum(bound(i) for i in plan.instances if i.role == role)
               for role in ("prefill", "decode"))


def colocated_on_same_devices(plan: Plan, baseline: Plan) -> Plan:
    """The baseline's best instance replicated over as many devices as `plan` uses."""
    assert baseline.colocated is not None
    per = baseline.colocated.tp * baseline.colocated.pp
    count = max(1, plan.devices_used // per)
    instances = [InstancePlacement(role="colocated", tp=baseline.colocated.tp,
                                   pp=baseline.colocated.pp,
                                   devices=[(k * per // plan.gpus_per_node, 0)])
                 for k in range(count)]
    return baseline.model_copy(update={"instances": instances, "devices_used": count * per,
                                       "colocated": baseline.colocated.model_copy(
                                           update={"count": count})})
