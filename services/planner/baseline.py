"""The colocated baseline (vLLM-style, optionally chunked prefill): the best per-device
configuration of one colocated instance, replicated to the rate."""

from __future__ import annotations

import dataclasses
import math

from services.planner.placement import (
    NoFeasiblePlan,
    Problem,
    assign_devices,
    best_config,
    colocated_goodput,
    parallel_map,
    phase_configs,
)
from services.planner.plan import InstancePlacement, PhasePlan, Plan
from services.planner.simulator import ColocatedCluster, InstanceSpec, simulate_colocated

# vLLM's scheduler defaults (the paper's baseline): a prefill step admits waiting prompts up
# to max_num_batched_tokens = max(context, 2048) tokens, and at most max_num_seqs run at once.
VLLM_MAX_NUM_BATCHED_TOKENS = 2048
VLLM_MAX_NUM_SEQS = 256


def colocated_plan(problem: Problem, chunked: bool = False, max_pp: int = 1) -> Plan:
    """vLLM parallelises within an instance by tensor parallelism (pp=1 by default)."""
    configs = [(tp, pp) for tp, pp in phase_configs(problem) if pp <= max_pp]
    if not configs:
        raise NoFeasiblePlan(f"{problem.profile.model.name} does not fit a colocated instance "
                             f"with pp <= {max_pp}")
    goodputs = parallel_map(colocated_goodput,
                         [(problem, tp, pp, chunked, VLLM_MAX_NUM_BATCHED_TOKENS,
                           VLLM_MAX_NUM_SEQS) for tp, pp in configs], problem.workers)
    (tp, pp), goodput = best_config(configs, goodputs, lambda c: c[0] * c[1], "colocated", problem)
    count = math.ceil(problem.rate / goodput)
    instances = assign_devices([("colocated", tp, pp)] * count, problem.nodes,
                               problem.gpus_per_node)
    if instances is None:
        raise NoFeasiblePlan(f"rate {problem.rate} rps needs {count} colocated instances of "
                             f"{tp * pp} devices: more than the cluster")
    return Plan(
        model=problem.profile.model.name, algorithm="colocated",
        mode="chunked" if chunked else "colocated", rate_rps=problem.rate,
        ttft_s=problem.slo.ttft_s, tpot_s=problem.slo.tpot_s,
        attainment_target=problem.target, nodes=problem.nodes,
        gpus_per_node=problem.gpus_per_node,
        colocated=PhasePlan(tp=tp, pp=pp, count=count, goodput_rps=goodput),
        instances=instances, devices_used=count * tp * pp,
        per_device_goodput_rps=goodput / (tp * pp), best_per_device_goodput_rps=goodput / (tp * pp),
        predicted_attainment=simulate_colocated(
            ColocatedCluster([colocated_spec(problem, i) for i in instances], chunked),
            problem.validation_requests(problem.rate)).attainment(problem.slo),
        max_batch_tokens=VLLM_MAX_NUM_BATCHED_TOKENS, max_running=VLLM_MAX_NUM_SEQS)


def colocated_spec(problem: Problem, placed: InstancePlacement,
                   batch_tokens: int = VLLM_MAX_NUM_BATCHED_TOKENS,
                   max_running: int = VLLM_MAX_NUM_SEQS) -> InstanceSpec:
    """A placed colocated instance with vLLM's scheduler limits (or the given ones)."""
    return dataclasses.replace(problem.instance(placed.tp, placed.pp, placed.devices[0][0]),
                               max_batch_tokens=batch_tokens, max_batch=max_running)
