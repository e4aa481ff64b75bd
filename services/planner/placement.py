"""Placement search (DistServe §4.1-4.2): enumerate parallel configurations that fit in
memory, find each one's goodput with the simulator, keep the best per device, replicate to the
target rate and put the instances on devices. Configurations are evaluated in parallel."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from services.planner.goodput import max_rate
from services.planner.plan import InstancePlacement, PhasePlan, Plan
from services.planner.profiles import Profile, kv_capacity_tokens
from services.planner.simulator import (
    ColocatedCluster,
    DisaggregatedCluster,
    InstanceSpec,
    Link,
    SimResult,
    simulate_colocated,
    simulate_decode_only,
    simulate_disaggregated,
)
from shared.metrics import SLO
from shared.workloads import Workload

T = TypeVar("T")


def instance_spec(profile: Profile, tp: int, pp: int, node: int = 0) -> InstanceSpec:
    """A simulated instance of `tp` x `pp` devices as the profile describes it (a decode
    instance of one CPU device takes a pull's blocks beside its step under way)."""
    return InstanceSpec(profile.latency(tp, pp), kv_capacity_tokens(profile, tp, pp),
                        profile.l_m, profile.max_decode_batch, node,
                        pulls_mid_step=profile.device.startswith("cpu") and tp * pp == 1,
                        noise=profile.noise)


def layout_cluster(profile: Profile, layout: Sequence[InstancePlacement], link: Link,
                   devices: int = 0) -> DisaggregatedCluster:
    """The disaggregated cluster of placed instances (each on its first device's node)."""
    def spec(i: InstancePlacement) -> InstanceSpec:
        return instance_spec(profile, i.tp, i.pp, node=i.devices[0][0])

    return DisaggregatedCluster([spec(i) for i in layout if i.role == "prefill"],
                                [spec(i) for i in layout if i.role == "decode"], link, devices)


class NoFeasiblePlan(ValueError):
    """No placement meets the objectives on this cluster; the message says why."""


@dataclass(frozen=True)
class Problem:
    profile: Profile
    workload: Workload
    slo: SLO
    rate: float
    nodes: int
    gpus_per_node: int
    target: float = 0.9
    intra_node_gbps: float = 600.0
    inter_node_gbps: float = 25.0
    num_requests: int = 400  # requests per simulation, at least
    duration_s: float = 60.0  # ... and enough to span this long, up to 8x num_requests
    seed: int = 0
    workers: int = 0  # processes for evaluating configurations; 0 = one per CPU
    batch_tokens: int = 0  # an instance's prompt tokens per step (0: the profile's L_m)
    max_batch: int = 0  # an instance's running requests at most (0: the profile's)

    @property
    def l_m(self) -> int:
        return self.batch_tokens or self.profile.l_m

    @property
    def max_decode_batch(self) -> int:
        return self.max_batch or self.profile.max_decode_batch

    @property
    def link(self) -> Link:
        return Link(self.profile.model.kv_bytes_per_token, self.intra_node_gbps * 1e9,
                    self.inter_node_gbps * 1e9)

    def instance(self, tp: int, pp: int, node: int = 0) -> InstanceSpec:
        return dataclasses.replace(instance_spec(self.profile, tp, pp, node),
                                   max_batch_tokens=self.l_m, max_batch=self.max_decode_batch)

    def fits(self, tp: int, pp: int) -> bool:
        lengths = self.workload.lengths
        largest = int((lengths.prompts + lengths.outputs).max())
        return kv_capacity_tokens(self.profile, tp, pp) >= largest

    def requests_at(self, rate: float) -> list[Any]:
        """A workload long enough that a rate the system cannot sustain builds a backlog."""
        n = min(max(self.num_requests, int(rate * self.duration_s)), 50 * self.num_requests)
        return self.workload.requests(rate, n, self.seed)

    def validation_requests(self, rate: float) -> list[Any]:
        """A long run for checking a finished plan: searches use short runs from an empty
        system, which flatter a configuration near its capacity."""
        n = min(max(5 * self.num_requests, int(rate * 5 * self.duration_s)), 50 * self.num_requests)
        return self.workload.requests(rate, n, self.seed + 1)

    def attainment_at(self, simulate: Callable[[Any], SimResult],
                      score: Callable[[SimResult], float]) -> Callable[[float], float]:
        def at(rate: float) -> float:
            return score(simulate(self.requests_at(rate)))
        return at


def parallel_map(fn: Callable[..., T], args: Sequence[tuple[Any, ...]], workers: int) -> list[T]:
    workers = workers or os.cpu_count() or 1
    if workers == 1 or len(args) <= 1:
        return [fn(*a) for a in args]
    with ProcessPoolExecutor(max_workers=min(workers, len(args))) as pool:
        return list(pool.map(fn, *zip(*args, strict=True)))


def _guess(problem: Problem, tp: int, pp: int) -> float:
    lat, lengths = problem.profile.latency(tp, pp), problem.workload.lengths
    new, cached = lengths.mean_computed, lengths.mean_cached
    return max(0.01, 1.0 / lat.prefill_stage_s(new, new * new, new * cached))


def prefill_bound(problem: Problem, tp: int, pp: int) -> float:
    """Requests/s one prefill instance sustains at best: full L_m batches back to back (of
    the tokens a prefill computes: a prompt's cached ones are not)."""
    lat, lengths = problem.profile.latency(tp, pp), problem.workload.lengths
    new, cached = lengths.mean_computed, lengths.mean_cached
    per_batch = max(1.0, problem.l_m / new)
    return per_batch / lat.prefill_stage_s(per_batch * new, per_batch * new * new,
                                           per_batch * new * cached)


def decode_bound(problem: Problem, tp: int, pp: int) -> float:
    """Requests/s one decode instance sustains at best: the largest batch KV memory allows."""
    lengths = problem.workload.lengths
    tokens = lengths.mean_prompt + lengths.mean_output
    batch = max(1, min(problem.max_decode_batch,
                       int(kv_capacity_tokens(problem.profile, tp, pp) / tokens)))
    context = lengths.mean_prompt + lengths.mean_output / 2
    step = problem.profile.latency(tp, pp).decode_step_s(batch, batch * context)
    return batch / step / max(1.0, lengths.mean_output - 1)


# -- per-configuration goodput (module level so worker processes can run them) ----------

def prefill_goodput(problem: Problem, tp: int, pp: int) -> float:
    """simu_prefill: one prefill instance, TTFT attainment only."""
    cluster = DisaggregatedCluster([problem.instance(tp, pp)], [], problem.link)
    at = problem.attainment_at(lambda w: simulate_disaggregated(cluster, w),
                               lambda r: r.ttft_attainment(problem.slo.ttft_s))
    return max_rate(at, problem.target, _guess(problem, tp, pp),
                    upper=prefill_bound(problem, tp, pp))


def decode_goodput(problem: Problem, tp: int, pp: int) -> float:
    """simu_decode: one decode instance fed as if prefill were instant, TPOT only."""
    spec = problem.instance(tp, pp)
    at = problem.attainment_at(lambda w: simulate_decode_only(spec, w),
                               lambda r: r.tpot_attainment(problem.slo.tpot_s))
    return max_rate(at, problem.target, _guess(problem, tp, pp),
                    upper=decode_bound(problem, tp, pp))


def segment_goodput(problem: Problem, pp: int, seg: tuple[int, int, int, int]) -> float:
    """Algorithm 2: n_p prefill and n_d decode instances whose stages share nodes."""
    n_p, tp_p, n_d, tp_d = seg
    cluster = DisaggregatedCluster([problem.instance(tp_p, pp)] * n_p,
                                   [problem.instance(tp_d, pp)] * n_d, problem.link)
    at = problem.attainment_at(lambda w: simulate_disaggregated(cluster, w),
                               lambda r: r.attainment(problem.slo))
    upper = min(n_p * prefill_bound(problem, tp_p, pp), n_d * decode_bound(problem, tp_d, pp))
    return max_rate(at, problem.target, _guess(problem, tp_p, pp) * n_p, upper=upper)


def colocated_goodput(problem: Problem, tp: int, pp: int, chunked: bool, batch_tokens: int,
                      max_batch: int) -> float:
    spec = dataclasses.replace(problem.instance(tp, pp), max_batch_tokens=batch_tokens,
                               max_batch=max_batch)
    cluster = ColocatedCluster([spec], chunked)
    at = problem.attainment_at(lambda w: simulate_colocated(cluster, w),
                               lambda r: r.attainment(problem.slo))
    upper = min(prefill_bound(problem, tp, pp), decode_bound(problem, tp, pp))
    return max_rate(at, problem.target, _guess(problem, tp, pp), upper=upper)


# -- the searches ------------------------------------------------------------------------

def phase_configs(problem: Problem) -> list[tuple[int, int]]:
    """(tp, pp) with tp inside a node and a profile, pp across nodes, that fit in memory."""
    total = problem.nodes * problem.gpus_per_node
    configs = [(tp, pp) for tp in problem.profile.tps if tp <= problem.gpus_per_node
               for pp in range(1, total // tp + 1) if problem.fits(tp, pp)]
    if not configs:
        raise NoFeasiblePlan(
            f"{problem.profile.model.name} does not fit on {problem.nodes} node(s) x "
            f"{problem.gpus_per_node} device(s) with the profiled parallelism "
            f"(tp in {problem.profile.tps})")
    return configs


def best_config(configs: Sequence[Any], goodputs: Sequence[float], devices: Callable[[Any], int],
          what: str, problem: Problem) -> tuple[Any, float]:
    scored = [(g / devices(c), c, g) for c, g in zip(configs, goodputs, strict=True) if g > 0]
    if not scored:
        raise NoFeasiblePlan(
            f"no {what} configuration meets TTFT {problem.slo.ttft_s}s / TPOT "
            f"{problem.slo.tpot_s}s for {problem.target:.0%} of requests at any rate")
    _, config, goodput = max(scored, key=lambda s: s[0])
    return config, goodput


def high_affinity(problem: Problem) -> Plan:
    """Algorithm 1: the goodput of every prefill and every decode configuration separately,
    then replicas to the target rate. The pair needing the fewest devices for the rate wins
    (ties: the best per-device goodput), if its replicas fit the cluster."""
    configs = phase_configs(problem)
    args = [(problem, tp, pp) for tp, pp in configs]
    gp_prefill = parallel_map(prefill_goodput, args, problem.workers)
    gp_decode = parallel_map(decode_goodput, args, problem.workers)
    best_config(configs, gp_prefill, lambda c: c[0] * c[1], "prefill", problem)  # raise if none
    best_config(configs, gp_decode, lambda c: c[0] * c[1], "decode", problem)
    def devices_for_rate(cp: tuple[int, int], gp: float, cd: tuple[int, int],
                         gd: float) -> int:
        return (math.ceil(problem.rate / gp) * cp[0] * cp[1]
                + math.ceil(problem.rate / gd) * cd[0] * cd[1])

    # cheapest at the target rate first (replicas come in whole instances), then the best
    # per-device goodput at the ideal prefill:decode ratio
    pairs = sorted(
        ((1.0 / (cp[0] * cp[1] / gp + cd[0] * cd[1] / gd), cp, gp, cd, gd)
         for cp, gp in zip(configs, gp_prefill, strict=True) if gp > 0
         for cd, gd in zip(configs, gp_decode, strict=True) if gd > 0),
        key=lambda pair: (devices_for_rate(*pair[1:]), -pair[0]))
    for per_device, cp, gp, cd, gd in pairs:
        n, m = math.ceil(problem.rate / gp), math.ceil(problem.rate / gd)
        if assign_devices([("prefill", *cp)] * n + [("decode", *cd)] * m, problem.nodes,
                          problem.gpus_per_node) is None:
            continue
        n, m, attained, instances = _replicate(problem, cp, cd, n, m)
        return Plan(
            model=problem.profile.model.name, algorithm="high-affinity",
            rate_rps=problem.rate, ttft_s=problem.slo.ttft_s, tpot_s=problem.slo.tpot_s,
            attainment_target=problem.target, nodes=problem.nodes,
            gpus_per_node=problem.gpus_per_node,
            prefill=PhasePlan(tp=cp[0], pp=cp[1], count=n, goodput_rps=gp),
            decode=PhasePlan(tp=cd[0], pp=cd[1], count=m, goodput_rps=gd),
            instances=instances, devices_used=sum(len(i.devices) for i in instances),
            per_device_goodput_rps=per_device, predicted_attainment=attained,
            best_per_device_goodput_rps=max(pair[0] for pair in pairs))
    raise NoFeasiblePlan(
        f"no prefill/decode configuration serves {problem.rate} rps within "
        f"{problem.nodes} x {problem.gpus_per_node} devices: lower the rate or add devices")


def _replicate(problem: Problem, cp: tuple[int, int], cd: tuple[int, int], n: int,
               m: int) -> tuple[int, int, float, list[InstancePlacement]]:
    """Place n prefill and m decode instances; while the whole cluster's simulated
    attainment misses the target, add the instance that helps most, room permitting."""
    for _ in range(16):
        layout = assign_devices([("prefill", *cp)] * n + [("decode", *cd)] * m,
                                problem.nodes, problem.gpus_per_node)
        if layout is None:
            raise NoFeasiblePlan(
                f"rate {problem.rate} rps needs {n} prefill (tp={cp[0]}, pp={cp[1]}) and {m} "
                f"decode (tp={cd[0]}, pp={cd[1]}) instances: more than "
                f"{problem.nodes} x {problem.gpus_per_node} devices")
        attained = _simulate_layout(problem, layout)
        if attained >= problem.target:
            return n, m, attained, layout
        more_p = _simulate_counts(problem, cp, cd, n + 1, m)
        more_d = _simulate_counts(problem, cp, cd, n, m + 1)
        n, m = (n + 1, m) if more_p >= more_d else (n, m + 1)
    raise NoFeasiblePlan(f"could not reach {problem.target:.0%} attainment at {problem.rate} rps")


def _simulate_counts(problem: Problem, cp: tuple[int, int], cd: tuple[int, int], n: int,
                     m: int) -> float:
    layout = assign_devices([("prefill", *cp)] * n + [("decode", *cd)] * m,
                            problem.nodes, problem.gpus_per_node)
    return -1.0 if layout is None else _simulate_layout(problem, layout)


def _simulate_layout(problem: Problem, layout: list[InstancePlacement]) -> float:
    cluster = layout_cluster(problem.profile, layout, problem.link)
    return simulate_disaggregated(cluster, problem.validation_requests(problem.rate)
                                  ).attainment(problem.slo)


def assign_devices(instances: Sequence[tuple[str, int, int]], nodes: int,
                   gpus_per_node: int) -> list[InstancePlacement] | None:
    """Each stage's tp devices on one node (intra-op needs the fast link), stages on any
    nodes; best fit, largest instances first. None when they do not fit."""
    free = [list(range(gpus_per_node)) for _ in range(nodes)]
    placed = []
    for role, tp, pp in sorted(instances, key=lambda i: -i[1] * i[2]):
        devices = []
        for _ in range(pp):
            fitting = [n for n in range(nodes) if len(free[n]) >= tp]
            if not fitting:
                return None
            node = min(fitting, key=lambda n: len(free[n]))
            devices += [(node, free[node].pop(0)) for _ in range(tp)]
        placed.append(InstancePlacement(role=role, tp=tp, pp=pp,  # type: ignore[arg-type]
                                        devices=devices))
    return placed
