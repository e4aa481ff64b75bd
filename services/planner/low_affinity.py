"""Algorithm 2 (low node-affinity): prefill and decode instances share pipeline stages' nodes,
so each stage's KV moves over the intra-node link. A node holds, for one stage, n_p prefill
segments of tp_p devices and n_d decode segments of tp_d devices; a replica spans pp nodes."""

from __future__ import annotations

import math

from services.planner.placement import (
    NoFeasiblePlan,
    Problem,
    best_config,
    parallel_map,
    segment_goodput,
)
from services.planner.plan import InstancePlacement, PhasePlan, Plan

Segment = tuple[int, int, int, int]  # n_p, tp_p, n_d, tp_d


def intra_node_configs(problem: Problem, pp: int) -> list[Segment]:
    tps = [tp for tp in problem.profile.tps if problem.fits(tp, pp)]
    m = problem.gpus_per_node
    return [(n_p, tp_p, n_d, tp_d) for tp_p in tps for tp_d in tps
            for n_p in range(1, m // tp_p + 1) for n_d in range(1, m // tp_d + 1)
            if n_p * tp_p + n_d * tp_d <= m]


def low_affinity(problem: Problem) -> Plan:
    configs = [(pp, seg) for pp in range(1, problem.nodes + 1)
               for seg in intra_node_configs(problem, pp)]
    if not configs:
        raise NoFeasiblePlan(
            f"{problem.profile.model.name}: no prefill+decode pair fits in one node of "
            f"{problem.gpus_per_node} devices per pipeline stage on {problem.nodes} node(s)")
    goodputs = parallel_map(segment_goodput, [(problem, pp, seg) for pp, seg in configs],
                         problem.workers)

    def devices(c: tuple[int, Segment]) -> int:
        pp, (n_p, tp_p, n_d, tp_d) = c
        return pp * (n_p * tp_p + n_d * tp_d)

    best_config(configs, goodputs, devices, "prefill+decode segment", problem)  # raise if none
    # cheapest at the target rate first (whole replicas), then the best per-device goodput
    _, (pp, seg), goodput = min(
        ((math.ceil(problem.rate / g) * devices(c), -g / devices(c)), c, g)
        for c, g in zip(configs, goodputs, strict=True) if g > 0)
    replicas = math.ceil(problem.rate / goodput)
    while True:  # add replicas until a long run of the whole plan meets the target
        instances = place_replicas(replicas, pp, seg, problem.nodes, problem.gpus_per_node)
        if instances is None:
            raise NoFeasiblePlan(
                f"rate {problem.rate} rps needs {replicas} replica(s) of {devices((pp, seg))} "
                f"devices over {pp} node(s): more than the cluster's {problem.nodes} node(s)")
        attained = _replica_attainment(problem, replicas, pp, seg)
        if attained >= problem.target:
            break
        replicas += 1
    n_p, tp_p, n_d, tp_d = seg
    return Plan(
        model=problem.profile.model.name, algorithm="low-affinity", rate_rps=problem.rate,
        ttft_s=problem.slo.ttft_s, tpot_s=problem.slo.tpot_s,
        attainment_target=problem.target, nodes=problem.nodes,
        gpus_per_node=problem.gpus_per_node,
        prefill=PhasePlan(tp=tp_p, pp=pp, count=n_p * replicas, goodput_rps=goodput / n_p),
        decode=PhasePlan(tp=tp_d, pp=pp, count=n_d * replicas, goodput_rps=goodput / n_d),
        instances=instances, devices_used=sum(len(i.devices) for i in instances),
        per_device_goodput_rps=goodput / devices((pp, seg)),
        predicted_attainment=attained,
        best_per_device_goodput_rps=max(g / devices(c) for c, g in zip(configs, goodputs,
                                                                       strict=True)))


def _replica_attainment(problem: Problem, replicas: int, pp: int, seg: Segment) -> float:
    """Replicas split the rate evenly: simulate one at rate / replicas."""
    from services.planner.simulator import DisaggregatedCluster, simulate_disaggregated

    n_p, tp_p, n_d, tp_d = seg
    cluster = DisaggregatedCluster([problem.instance(tp_p, pp)] * n_p,
                                   [problem.instance(tp_d, pp)] * n_d, problem.link)
    return simulate_disaggregated(cluster, problem.validation_requests(
        problem.rate / replicas)).attainment(problem.slo)


def place_replicas(replicas: int, pp: int, seg: Segment, nodes: int,
                   gpus_per_node: int) -> list[InstancePlacement] | None:
    n_p, tp_p, n_d, tp_d = seg
    width = n_p * tp_p + n_d * tp_d
    free = [gpus_per_node] * nodes
    instances: list[InstancePlacement] = []
    for _ in range(replicas):
        stage_nodes = []
        for _ in range(pp):
            fitting = [n for n in range(nodes) if free[n] >= width and n not in stage_nodes]
            if not fitting:
                return None
            stage_nodes.append(min(fitting, key=lambda n: free[n]))
            free[stage_nodes[-1]] -= width
        offsets = {n: gpus_per_node - free[n] - width for n in stage_nodes}
        for role, count, tp in (("prefill", n_p, tp_p), ("decode", n_d, tp_d)):
            for _ in range(count):
                devices = []
                for node in stage_nodes:
                    devices += [(node, offsets[node] + k) for k in range(tp)]
                    offsets[node] += tp
                instances.append(InstancePlacement(role=role, tp=tp, pp=pp,  # type: ignore[arg-type]
                                                   devices=devices))
    return instances
