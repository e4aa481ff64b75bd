"""Disaggregated against colocated on this machine: the same engine, threads per worker,
workload and rates; one system up at a time. With a profile, the planner's simulator runs
the same requests on the same placements (the paper's Table 2)."""

from __future__ import annotations

import dataclasses
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distserve.bench.loadgen import Target
from distserve.bench.results import (
    STAGES,
    RequestRecord,
    RunResult,
    handoff_s,
    span_seconds,
)
from distserve.bench.runner import CALIBRATION_TOKENS, Unloaded, calibrate, read_spans, sweep
from distserve.bench.steps import Live, StepRecorder, live_profile, steps_from_json
from distserve.bench.workload import BenchWorkload
from services.launcher import Stack, StackConfig
from services.planner.budget import ONE
from services.planner.calibration import Calibration
from services.planner.latency import LatencyModel
from services.planner.modes import Candidate, Mode, candidates, cluster
from services.planner.placement import Problem
from services.planner.profiles import Profile
from services.planner.simulator.core import SimResult
from services.process import WorkerSettings
from services.supervisor import free_port
from shared.metrics import SLO, attains
from shared.workloads import NO_CACHE, POOL_CACHE, PrefixCaching, WorkloadRequest

DEFAULT_LINK_BPS = 0.5e9  # UCX between two local processes (loopback TCP), measured


@dataclass(frozen=True)
class System:
    name: str
    stack: StackConfig

    @property
    def mode(self) -> Mode:
        if self.stack.mode == "disaggregated":
            return "disaggregated"
        return "chunked" if self.stack.chunked_prefill else "colocated"

    @property
    def devices(self) -> int:
        c = self.stack
        return c.replicas if c.mode == "colocated" else c.prefill + c.decode


def systems(threads: int, kv_cache_mb: int, chunked: bool, weights: str = "auto",
            decode_weights: str = "", prefill_dtype: str = "",
            prefix_caching: bool = False) -> list[System]:
    """1 prefill + 1 decode against 2 colocated replicas (and chunked-prefill replicas): two
    workers, `threads` each, in every system. Every worker's weights are `weights`, but the
    decode instance's `decode_weights` where given, and the prefill instance computes in
    `prefill_dtype` where given: disaggregation lets each phase run its own format, while a
    colocated worker runs one for both, so colocated replicas are then run in each. A format
    other than the default is named after the system. The workers cache prefixes only with
    `prefix_caching` (a workload whose prompts share them: each run's requests have a salt
    of their own, so none finds the runs' before, and each is simulated with the tokens its
    stack found)."""
    common: dict[str, Any] = {"threads": threads, "kv_cache_mb": kv_cache_mb,
                              "weights": weights, "prefix_caching": prefix_caching}
    every = "" if weights == "auto" else f" ({weights})"
    split = decode_weights not in ("", weights)  # the phases in two formats
    parts = [weights] if every else []
    parts += [f"prefill {prefill_dtype}"] if prefill_dtype else []
    parts += [f"decode {decode_weights}"] if split else []
    named = f" ({', '.join(parts)})" if parts else ""
    out = [System(f"disaggregated 1P+1D{named}",
                  StackConfig(mode="disaggregated", decode_weights=decode_weights,
                              prefill_dtype=prefill_dtype, **common)),
           System(f"colocated x2{every}", StackConfig(mode="colocated", replicas=2, **common))]
    if chunked:
        out.append(System(f"chunked x2{every}", StackConfig(
            mode="colocated", replicas=2, chunked_prefill=True, **common)))
    if split:
        out.append(System(f"colocated x2 ({decode_weights})", StackConfig(
            mode="colocated", replicas=2, **common | {"weights": decode_weights})))
    if prefill_dtype:
        out.append(System(f"colocated x2 ({prefill_dtype})", StackConfig(
            mode="colocated", replicas=2, dtype=prefill_dtype, **common)))
    return out


@dataclass
class Measured:
    system: System
    runs: list[RunResult]
    unloaded: Unloaded
    link_bps: float | None  # KV transfer rate seen in the traces (disaggregated only)
    cores_used: dict[str, float]  # each process's CPU time over the runs' wall time


def next_rate(runs: Sequence[RunResult], slo: SLO, target: float, grid: int, most: int,
              step: float = 1.5) -> float | None:
    """Past a rate grid of `grid` runs, the next rate that brackets the goodput: the lowest
    rate run / `step` while that one missed the target (the goodput would be 0), `step` x the
    highest while every run met it (it would only be a lower bound); None once it is
    bracketed, or after `most` extra runs."""
    extra = len(runs) - grid
    if not runs or extra < 0 or extra >= most:
        return None
    lowest = min(runs, key=lambda run: run.rate)
    if lowest.attainment(slo) < target:
        lower = round(lowest.rate / step, 3)
        return lower if lower > 0 else None
    if all(run.attainment(slo) >= target for run in runs):
        return round(max(run.rate for run in runs) * step, 3)
    return None


@dataclass
class RateGrid:
    """The rates every system runs and the objectives, both set from the first system's
    unloaded latencies (`rates` and `slo` given up front win), and how far past the grid each
    system goes to bracket its own goodput (`extend` extra runs at most)."""

    factors: Sequence[float]
    mean_output: float
    slo_of: Callable[[Unloaded], SLO]
    target: float
    extend: int
    rates: list[float] = dataclasses.field(default_factory=list)
    slo: SLO | None = None

    def start(self, unloaded: Unloaded) -> list[float]:
        if not self.rates:
            self.rates.extend(auto_rates(unloaded, self.mean_output, 2, self.factors))
        if self.slo is None:
            self.slo = self.slo_of(unloaded)
        return self.rates

    def more(self, runs: Sequence[RunResult]) -> float | None:
        assert self.slo is not None, "start() comes first"
        return next_rate(runs, self.slo, self.target, len(self.rates), self.extend)


def measure(system: System, workload: BenchWorkload, grid: RateGrid, requests: int,
            seed: int, run_root: Path, log: Callable[[str], None]) -> Measured:
    """Bring `system` up, calibrate, run the grid's rates (and past them until its goodput is
    bracketed), bring it down."""
    config = dataclasses.replace(system.stack, port=free_port(), run_dir=run_root)
    stack = Stack(config)
    log(f"starting {system.name} (logs in {stack.run_dir})")
    stack.start()
    try:
        target = Target(stack.url, config.model, timeout_s=600)
        unloaded = calibrate(target, workload)
        log(f"{system.name}: unloaded TTFT {1e3 * unloaded.ttft_s:.0f} ms, TPOT "
            f"{1e3 * unloaded.tpot_s:.1f} ms at a {unloaded.prompt_tokens}-token prompt")
        cpu_before, started = stack.cpu_seconds(), time.monotonic()
        recorder = StepRecorder(stack.env["DS_REDIS_URL"])
        try:
            runs = sweep(target, workload, grid.start(unloaded), requests, seed, system.name,
                         trace_dir=stack.run_dir, more=grid.more, recorder=recorder)
        finally:
            recorder.close()
        if len(runs) > len(grid.rates):
            log(f"{system.name}: past the grid at " +
                ", ".join(f"{run.rate:g}" for run in runs[len(grid.rates):]) +
                " req/s, to bracket its goodput")
        elapsed = time.monotonic() - started
        cpu = {name: (used - cpu_before.get(name, 0.0)) / elapsed
               for name, used in stack.cpu_seconds().items()}
        log(f"{system.name}: cores used during the runs: " +
            ", ".join(f"{name} {share:.2f}" for name, share in cpu.items()))
        spans = read_spans(stack.run_dir)
    finally:
        stack.stop()
    rates_bps = [s["attributes"]["bytes"] / span_seconds(s) for s in spans
                 if s["name"] == "kv transfer" and span_seconds(s) > 0]
    unloaded = dataclasses.replace(unloaded, handoff_s=handoff_s(spans, unloaded.probes))
    return Measured(system, runs, unloaded, statistics.median(rates_bps) if rates_bps else None,
                    cpu)


def calibration_from(latency: LatencyModel, unloaded: Unloaded,
                     transfer_s: float = 0.0) -> Calibration:
    """Prefill and decode scales that make `latency` predict the unloaded TTFT and TPOT
    measured through the running stack (workers sharing the cores, the gateway and the
    network included), which a profile of the engine alone does not see. `transfer_s`: the
    KV handoff inside that TPOT (after the first token, before the second), which the
    simulator models on its own and so must not be counted in the decode steps too."""
    prompt = unloaded.prompt_tokens
    decoding = unloaded.tpot_s - transfer_s / (CALIBRATION_TOKENS - 1)
    return Calibration(
        prefill=unloaded.ttft_s / latency.prefill_latency_s(prompt, prompt * prompt),
        decode=decoding / latency.decode_step_s(1, prompt + CALIBRATION_TOKENS / 2))


def calibrated_profile(measured: Measured, profile: Profile) -> Profile:
    """`profile` scaled to `measured`'s unloaded latencies, less its KV handoff: as the
    probes' spans timed it, else (a run recorded before they did) the KV's bytes at the
    link's rate. Idle, a handoff can take several times what it takes under load (here 41
    ms for a 124-token prompt, against 5-10 ms within a sweep: the pulls themselves run at
    0.25 GB/s one at a time), and left in the decode steps it prices every step of every
    mode that much slower."""
    unloaded, transfer_s = measured.unloaded, 0.0
    if measured.system.mode == "disaggregated":
        transfer_s = unloaded.handoff_s if unloaded.handoff_s is not None else \
            profile.model.kv_bytes_per_token * unloaded.prompt_tokens / (
                measured.link_bps or DEFAULT_LINK_BPS)
    return calibration_from(profile.latency(1, 1), unloaded, transfer_s).apply(profile)


def stack_problem(measured: Measured, profile: Profile, workload: BenchWorkload, slo: SLO,
                  target: float, rate: float, calibrate: bool = True) -> Problem:
    """The planner's problem for `measured`'s stack: its workers' KV pool and scheduler
    limits, the KV link it measured, and (with `calibrate`) the profile scaled to its
    unloaded latencies."""
    settings = WorkerSettings()
    kv_tokens = (measured.system.stack.kv_cache_mb << 20) // profile.model.kv_bytes_per_token
    if calibrate:
        profile = calibrated_profile(measured, profile)
    link_gbps = (measured.link_bps or DEFAULT_LINK_BPS) / 1e9
    cache = kv_tokens if measured.system.stack.prefix_caching else NO_CACHE
    return Problem(dataclasses.replace(profile, kv_capacity={(1, 1): kv_tokens}),
                   workload.as_workload(cache), slo, rate, 1, 2, target, intra_node_gbps=link_gbps,
                   workers=1, batch_tokens=settings.max_batch_tokens,
                   max_batch=settings.max_running)


def simulate(measured: Measured, profile: Profile, workload: BenchWorkload, slo: SLO,
             calibrate: bool = True) -> list[SimResult]:
    """`measured`'s system simulated at each of its rates on the requests it was sent (their
    arrival times and lengths); with `calibrate`, the profile is first scaled to the
    system's measured unloaded latencies."""
    problem = stack_problem(measured, profile, workload, slo, 0.9, 1.0, calibrate)
    return [_simulate_run(measured, problem, run) for run in measured.runs]


DRAWS = 40  # simulations a rate with the steps' times drawn as the stack's scattered


@dataclass(frozen=True)
class LiveRun:
    """One rate simulated on the steps the stack ran at it: the fit (`live`), the
    simulation with every step at its fit (`result`), and the attainments of `DRAWS`
    simulations of the same requests with the steps' times drawn as they scattered
    (`live.noise`; none where too few steps were recorded)."""

    live: Live
    result: SimResult
    draws: tuple[float, ...] = ()

    def band(self) -> tuple[float, float, float] | None:
        """The draws' (10th percentile, mean, 90th percentile) attainment; None without."""
        if len(self.draws) < 2:
            return None
        deciles = statistics.quantiles(self.draws, n=10, method="inclusive")
        return deciles[0], statistics.fmean(self.draws), deciles[-1]


def simulate_live(measured: Measured, profile: Profile, workload: BenchWorkload, slo: SLO,
                  draws: int = DRAWS) -> list[LiveRun | None]:
    """Each rate simulated on the profile fitted to the engine steps the stack's workers
    ran at that rate (`steps.live_profile`: calibrated as the online planner calibrates,
    on the steps that ran alone, and the contention of those that ran beside another
    instance's), with the fit; None for a run recorded without its steps. Its step times
    are the stack's own, so what is left between this and the measurement is the
    simulator's (queues, batches, dispatch) and the run's chance: which the `draws`
    simulations with the steps' times scattered as the stack's were tell (near an
    instance's capacity a run's attainment spreads by tens of points on them)."""
    out: list[LiveRun | None] = []
    for run in measured.runs:
        if not run.steps:
            out.append(None)
            continue
        live = live_profile(run.steps, profile)
        problem = stack_problem(measured, live.profile, workload, slo, 0.9, 1.0,
                                calibrate=False)
        scattered = () if live.noise.none else tuple(_simulate_run(
            measured, dataclasses.replace(problem, profile=live.noisy(seed)), run
        ).attainment(slo) for seed in range(draws))
        out.append(LiveRun(live, _simulate_run(measured, problem, run), scattered))
    return out


def _simulate_run(measured: Measured, problem: Problem, run: RunResult,
                  sent: BenchWorkload | None = None) -> SimResult:
    """`run`'s requests simulated on `problem`, each with its prompt's tokens the stack's
    prefix caches found (priced as not computed); or with `sent` (the workload, sent in
    order), those the prefix cache model finds in the instance each goes to, each instance's
    cache its KV pool."""
    c = measured.system.stack
    counts = (c.prefill, c.decode, 0) if c.mode == "disaggregated" else (0, 0, c.replicas)
    caching = None if sent is None else PrefixCaching(sent.block_tokens, POOL_CACHE)
    return cluster(problem, measured.system.mode, counts)(
        [WorkloadRequest(r.arrival_s, r.prompt_tokens, r.max_tokens, r.cached_tokens)
         if sent is None else WorkloadRequest(r.arrival_s, r.prompt_tokens, r.max_tokens, 0,
                                              sent.prefix_of(r.index), caching)
         for r in run.records])


@dataclass(frozen=True)
class CacheFit:
    """How the prefix cache model predicts one rate's cached tokens, over its completed
    requests: the shares of their prompt tokens the stack's caches found and the model's
    did, and the requests whose count it predicts to the token."""

    measured: float
    modelled: float
    exact: int
    requests: int


def cache_fits(measured: Measured, profile: Profile, workload: BenchWorkload, slo: SLO
               ) -> list[CacheFit]:
    """Where `measured`'s stack cached prefixes of a workload whose prompts share them
    (sent in order): each rate's requests simulated with the prefix cache model (each
    instance its own, dispatched to as the gateway does: simulator/prefixes.py) in place of
    the tokens the stack found, against those: those it answered whole (only their usage
    says what was found). A request that never had its first token (refused, or lost in a
    prefill) is left out: it may never have reached a cache. Empty where there is nothing
    to predict."""
    if not (measured.system.stack.prefix_caching and workload.shares_prefixes
            and workload.in_order):
        return []
    problem = stack_problem(measured, profile, workload, slo, 0.9, 1.0)
    out = []
    for run in measured.runs:
        prefilled = dataclasses.replace(run, records=[r for r in run.records
                                                      if r.first_token_s is not None])
        sim = _simulate_run(measured, problem, prefilled, workload)
        done = [(r, s) for r, s in zip(prefilled.records, sim.requests, strict=True) if r.ok]
        prompts = max(1, sum(r.prompt_tokens for r, _ in done))
        out.append(CacheFit(sum(r.cached_tokens for r, _ in done) / prompts,
                            sum(s.cached for _, s in done) / prompts,
                            sum(r.cached_tokens == s.cached for r, s in done), len(done)))
    return out


def recorded(report: dict[str, Any]) -> list[Measured]:
    """The systems of a results.json that `bench compare` wrote, as measured: what
    `--from` simulates again (with another profile, or a newer simulator)."""
    threads = int(report["threads_per_worker"])
    kv_cache_mb = int(report.get("kv_cache_mb", 256))
    known = {s.name: s for s in systems(threads, kv_cache_mb, chunked=True,
                                         weights=report.get("weights", "auto"),
                                         decode_weights=report.get("decode_weights", ""),
                                         prefill_dtype=report.get("prefill_dtype", ""),
                                         prefix_caching=report.get("prefix_caching", False))}
    out = []
    for entry in report["systems"]:
        if entry["name"] not in known:
            raise ValueError(f"{entry['name']!r} is not a system bench compare runs")
        runs = [RunResult(run["rate"], [RequestRecord(**{
                    k: v for k, v in record.items() if k in RECORD_FIELDS})
                    for record in run["records"]],
                    run["completed"] / run["throughput_rps"] if run["throughput_rps"] else 0.0,
                    run.get("breakdown_s") or {}, steps_from_json(run.get("steps") or {}))
                for run in entry["runs"]]
        out.append(Measured(known[entry["name"]], runs, Unloaded(**entry["unloaded"]),
                            entry.get("kv_link_bps"), entry.get("cores_used", {})))
    return out


RECORD_FIELDS = {f.name for f in dataclasses.fields(RequestRecord)}


@dataclass(frozen=True)
class Fidelity:
    """How one rate's simulation matches its measurement request by request (the same
    requests, in the same order): median measured - simulated TTFT and TPOT, and the
    requests whose outcome against the objectives differs (each is 1/n of the attainment
    gap; a request near an objective flips on a few ms)."""

    ttft_s: float
    tpot_s: float
    differ: int
    near: int  # of those, the ones where measured and simulated lie within `near_share` of
    # each objective they disagree on: flips of a few ms at the boundary, not of the model
    # mean seconds a request spends in each stage, (measured, simulated), for the stages the
    # services' spans time (a disaggregated stack's five; a colocated worker's three)
    stages_s: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# the services' span of each stage -> the simulator's name for it (SimResult.breakdown)
SIMULATED_STAGES = dict(zip(STAGES, ("prefill_queue", "prefill_run", "transfer",
                                     "decode_queue", "decode_run"), strict=True))


def stages(run: RunResult, simulated: SimResult) -> dict[str, tuple[float, float]]:
    """Where a request's time goes, measured (the services' spans) and simulated: the mean
    seconds of each stage both have, in the order a request passes them."""
    sim = simulated.breakdown()
    return {stage: (run.breakdown_s[stage], sim[name])
            for stage, name in SIMULATED_STAGES.items()
            if stage in run.breakdown_s and name in sim}


def fidelity(run: RunResult, simulated: SimResult, slo: SLO, near_share: float = 0.05
             ) -> Fidelity:
    pairs = list(zip(run.records, simulated.requests, strict=True))
    ttft = [r.ttft - s.ttft for r, s in pairs if r.ttft is not None and s.ttft is not None]
    tpot = [r.tpot - s.tpot for r, s in pairs if r.tpot is not None and s.tpot is not None]
    def near_bound(x: float | None, y: float | None, bound: float) -> bool:
        if x is not None and y is not None and (x <= bound) == (y <= bound):
            return True  # not what they disagree on
        return x is not None and y is not None and \
            max(abs(x - bound), abs(y - bound)) <= near_share * bound

    differ = near = 0
    for r, s in pairs:
        if attains(r.ttft, r.tpot, slo) == attains(s.ttft, s.tpot, slo):
            continue
        differ += 1
        near += near_bound(r.ttft, s.ttft, slo.ttft_s) and near_bound(r.tpot, s.tpot, slo.tpot_s)
    return Fidelity(statistics.median(ttft) if ttft else math.nan,
                    statistics.median(tpot) if tpot else math.nan, differ, near,
                    stages(run, simulated))


def recommend(measured: Measured, profile: Profile, workload: BenchWorkload, slo: SLO,
              target: float, rate: float) -> list[Candidate]:
    """What the planner weighs for these two devices, on the profile calibrated to
    `measured`'s unloaded latencies: each mode's simulated goodput (modes.candidates), every
    worker of one rank as the systems compared run."""
    return candidates(stack_problem(measured, profile, workload, slo, target, rate), 2,
                      fixed={"prefill": ONE, "decode": ONE, "colocated": ONE})


def default_run_root() -> Path:
    return Path(tempfile.gettempdir()) / "distserve-bench"


def auto_rates(unloaded: Unloaded, mean_output: float, devices: int,
               factors: Sequence[float]) -> list[float]:
    """Rates around what `devices` workers serve one request at a time each: factors x
    devices / (TTFT + mean output x TPOT), unloaded."""
    base = devices / (unloaded.ttft_s + mean_output * unloaded.tpot_s)
    return [round(base * f, 3) for f in factors]
