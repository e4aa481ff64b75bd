"""`distserve plan`: the goodput-optimal placement for a workload, SLOs and a cluster."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from distserve.commands.common import non_negative_int, positive_float, positive_int
from distserve.commands.workload_arg import WORKLOAD_HELP, add_context_args, parse_workload
from services.planner.baseline import colocated_plan
from services.planner.low_affinity import low_affinity
from services.planner.models import UnknownModelError
from services.planner.placement import NoFeasiblePlan, Problem, high_affinity
from services.planner.plan import ModeCandidate, Plan
from services.planner.plan_sim import cached_share, served_rps
from services.planner.profiles import (
    Profile,
    ProfileError,
    load_prefill_profile,
    load_profile,
    with_prefill_of,
)
from shared.metrics import SLO
from shared.workloads import WorkloadError


def add_problem_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", help="latency profile file (ours or the "
                   "DistServe artifact's format)")
    p.add_argument("--model", help="which model of a multi-model profile file")
    p.add_argument("--workload",
                   help=WORKLOAD_HELP)
    p.add_argument("--cv", type=positive_float, default=1.0,
                   help="arrival CV (1 = Poisson; gamma else)")
    add_context_args(p)
    p.add_argument("--ttft", type=positive_float, help="TTFT objective, seconds")
    p.add_argument("--tpot", type=positive_float, help="TPOT objective, seconds")
    p.add_argument("--attainment", type=float, default=0.9, help="share of requests that must "
                   "meet both objectives (default: %(default)s)")
    p.add_argument("--requests", type=positive_int, default=2000,
                   help="requests per simulation (fewer: faster, noisier goodput; default: "
                        "%(default)s)")
    p.add_argument("--seed", type=non_negative_int, default=0)


def register(sub: Any) -> None:
    p = sub.add_parser("plan", help="search the goodput-optimal placement",
                       description="Search the placement (instances per phase, tensor and "
                                   "pipeline parallelism, devices) with the highest per-device "
                                   "goodput that serves --rate (DistServe Algorithms 1 and 2).")
    add_problem_args(p)
    p.add_argument("--rate", type=positive_float, help="target request rate (req/s)")
    p.add_argument("--nodes", type=int)
    p.add_argument("--gpus-per-node", type=int)
    p.add_argument("--mode", choices=["auto", "disaggregated", "colocated", "chunked"],
                   default="auto", help="auto (default): search disaggregated, colocated and "
                   "chunked-prefill colocated serving and recommend, of the placements that "
                   "meet the target at the rate, the one on the fewest devices, then the one "
                   "that serves most per device simulated whole; otherwise search that mode "
                   "only")
    p.add_argument("--affinity", choices=["high", "low"], default="high",
                   help="high: fast links between nodes (Algorithm 1); low: KV must stay in a "
                        "node (Algorithm 2)")
    p.add_argument("--intra-bw", type=positive_float, default=600.0, help="intra-node GB/s")
    p.add_argument("--inter-bw", type=positive_float, default=25.0, help="inter-node GB/s")
    p.add_argument("--prefill-profile", metavar="PROFILE",
                   help="a second profile to price the disaggregated prefill instances with, "
                   "measured in another compute dtype (distserve profile --dtype bfloat16): "
                   "the disaggregated mode is searched with each, and the plan says the "
                   "prefill dtype it chose (distserve up --plan starts it so)")
    p.add_argument("--baseline-profile", help="also plan a colocated baseline with this "
                   "profile (e.g. the artifact's vLLM profile) and print the goodput ratio")
    p.add_argument("--workers", type=non_negative_int, default=0, help="processes (0: one per CPU)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON, last line")
    p.add_argument("--output", "-o", help="also write the plan JSON to this file")
    live = p.add_argument_group("a running stack (distserve up --planner auto)")
    live.add_argument("--live", action="store_true",
                      help="print the plan in force, why it was made, and the profiler's view "
                           "(instead of searching)")
    live.add_argument("--replan", action="store_true", help="with --live: ask the planner to "
                      "plan again now for the latest workload")
    live.add_argument("--run-dir", type=Path, default=Path("runs"),
                      help="where distserve up keeps its runs (the newest one is read)")
    live.add_argument("--redis-url", help="the stack's Redis (default: from the newest run)")
    live.add_argument("--nats-url", help="the stack's NATS (default: from the newest run)")
    p.set_defaults(parser=p, run=run)


SEARCH_ARGS = ("profile", "workload", "ttft", "tpot", "rate", "nodes", "gpus_per_node")


def build_problem(args: argparse.Namespace, parser: argparse.ArgumentParser,
                  profile_path: str, rate: float) -> Problem:
    if not 0 < args.attainment <= 1:
        parser.error("--attainment must be in (0, 1]")
    try:
        profile = load_profile(profile_path, args.model)
        workload = parse_workload(args.workload, args.cv, max_context=args.max_context,
                                  fit=args.fit, prefix_cache=args.prefix_cache)
    except (ProfileError, UnknownModelError, WorkloadError) as e:
        parser.error(str(e))
    return Problem(profile, workload, SLO(args.ttft, args.tpot), rate,
                   getattr(args, "nodes", 1), getattr(args, "gpus_per_node", 1),
                   args.attainment, getattr(args, "intra_bw", 600.0),
                   getattr(args, "inter_bw", 25.0), args.requests, seed=args.seed,
                   workers=getattr(args, "workers", 0))


def plan_table(plan: Plan, seconds: float) -> Table:
    table = Table(title=f"{plan.algorithm} placement for {plan.model} at {plan.rate_rps} req/s "
                        f"({seconds:.1f} s search)")
    for column in ("phase", "tp", "pp", "instances", "devices", "goodput/instance"):
        table.add_column(column, justify="right")
    for name, phase in (("prefill", plan.prefill), ("decode", plan.decode),
                        ("colocated", plan.colocated)):
        if phase is not None:
            table.add_row(name, str(phase.tp), str(phase.pp), str(phase.count),
                          str(phase.devices), f"{phase.goodput_rps:.2f} req/s")
    table.caption = (f"{plan.devices_used} of {plan.nodes * plan.gpus_per_node} devices; "
                     f"per-device goodput {plan.per_device_goodput_rps:.3f} req/s (best "
                     f"searched {plan.best_per_device_goodput_rps:.3f}); "
                     + (f"simulated whole, the placement serves {plan.served_per_device_rps:.3f}"
                        " req/s per device; " if plan.served_per_device_rps else "")
                     + f"simulated attainment at the rate {plan.predicted_attainment:.1%}"
                     + ("" if meets_target(plan) else
                        f" (below the {plan.attainment_target:.0%} target)"))
    return table


def search_modes(problem: Problem, args: argparse.Namespace,
                 prefilled: tuple[Problem, Profile] | None = None) -> list[Plan | ModeCandidate]:
    """The best plan of each mode asked for (or why it has none), with what its placement
    serves simulated whole; the disaggregated mode also on `prefilled`'s problem, its prefill
    instances priced by that profile."""
    modes = ["disaggregated", "colocated", "chunked"] if args.mode == "auto" else [args.mode]
    search = high_affinity if args.affinity == "high" else low_affinity
    out: list[Plan | ModeCandidate] = []
    for mode in modes:
        tries = [(problem, "")]
        if mode == "disaggregated" and prefilled is not None:
            tries.append((prefilled[0], prefilled[1].dtype))
        for on, dtype in tries:
            try:
                found = (search(on).model_copy(update={"prefill_dtype": dtype})
                         if mode == "disaggregated"
                         else colocated_plan(on, chunked=mode == "chunked"))
                out.append(found.model_copy(update={
                    "served_per_device_rps": served_rps(found, on) / found.devices_used}))
            except NoFeasiblePlan as e:
                out.append(ModeCandidate(mode=mode, placement="", error=str(e),  # type: ignore[arg-type]
                                         prefill_dtype=dtype))
    return out


def prefill_problem(args: argparse.Namespace, parser: argparse.ArgumentParser,
                    problem: Problem) -> tuple[Problem, Profile] | None:
    """`problem` with its prefill priced by `--prefill-profile`, and that profile (None
    without one)."""
    if not args.prefill_profile:
        return None
    if args.mode not in ("auto", "disaggregated"):
        parser.error(f"--prefill-profile prices disaggregated prefill instances; --mode "
                     f"{args.mode} has none (a colocated worker runs one dtype: plan it with "
                     "that dtype's profile as --profile)")
    try:
        prefiller = load_prefill_profile(args.prefill_profile, problem.profile, args.model)
        mixed = with_prefill_of(problem.profile, prefiller)
    except ProfileError as e:
        parser.error(f"--prefill-profile: {e}")
    return dataclasses.replace(problem, profile=mixed), prefiller


def meets_target(plan: Plan) -> bool:
    return plan.predicted_attainment >= plan.attainment_target


def no_placement_meets(plan: Plan) -> str:
    devices = plan.nodes * plan.gpus_per_node
    return (f"no placement meets the {plan.attainment_target:.0%} attainment target at "
            f"{plan.rate_rps} req/s on {devices} device{'s' if devices > 1 else ''}")


def rank(plan: Plan) -> tuple[bool, int, float, float]:
    """How plans of different modes compare, best highest: one that meets the target at the
    rate (the searches can return one that misses it), then the fewest devices, then the most
    served per device simulated whole, then the search's own figure."""
    return (meets_target(plan), -plan.devices_used,
            plan.served_per_device_rps, plan.best_per_device_goodput_rps)


def modes_table(candidates: list[ModeCandidate], chosen: Plan) -> Table:
    table = Table(title=f"serving modes for {chosen.model} at {chosen.rate_rps} req/s")
    cached = any(c.cached_share is not None for c in candidates)
    for column in ("mode", "placement", "devices", "served/dev", "search/dev", "attained",
                   *("cached",) * cached):
        left = column in ("mode", "placement")  # a placement may wrap (a mode's error)
        table.add_column(column, justify="left" if left else "right", no_wrap=column == "mode")
    for c in candidates:
        if c.error:
            table.add_row(c.label, f"none: {c.error}", "", "", "", "", *("",) * cached)
        else:
            table.add_row(c.label, c.placement, str(c.devices_used),
                          f"{c.served_per_device_rps:.3f}",
                          f"{c.best_per_device_goodput_rps:.3f}", f"{c.predicted_attainment:.1%}",
                          *(f"{c.cached_share or 0.0:.1%}",) * cached)
    why = ("of the placements that meet the target at the rate" if meets_target(chosen)
           else f"{no_placement_meets(chosen)}; of the best found")
    table.caption = (f"recommended: {chosen.candidate().label} ({why}, the fewest devices, "
                     "then the most served per device). placement: its instances; served/dev: "
                     "the "
                     "highest rate the placement serves, simulated whole (both objectives at "
                     "once, KV handoffs, the host's contention), per device; search/dev: the best "
                     "per-device goodput of the mode's configurations as its search priced "
                     "them (disaggregated: each phase alone, Algorithm 1); attained: simulated "
                     "attainment of the placement at the rate. Colocated modes run vLLM's "
                     "scheduler limits (2048 tokens a step, 256 requests)."
                     + (" cached: the share of the prompt tokens the placement's instances "
                        "find in their prefix caches at the rate (simulated)." if cached
                        else ""))
    return table


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.live:
        from distserve.commands.live import show_live

        return show_live(args, parser)
    if args.replan:
        parser.error("--replan goes with --live")
    missing = [name for name in SEARCH_ARGS if getattr(args, name) is None]
    if missing:
        parser.error("the following arguments are required: " +
                     ", ".join("--" + m.replace("_", "-") for m in missing))
    if args.nodes < 1 or args.gpus_per_node < 1:
        parser.error("--nodes and --gpus-per-node must be at least 1")
    if args.output:
        check_output(Path(args.output), parser)
    problem = build_problem(args, parser, args.profile, args.rate)
    console = Console(stderr=args.json)
    start = time.perf_counter()
    prefilled = prefill_problem(args, parser, problem)
    searched = search_modes(problem, args, prefilled)
    plans = [p for p in searched if isinstance(p, Plan)]
    if not plans:
        return report_infeasible([p for p in searched if isinstance(p, ModeCandidate)],
                                 args.json)
    chosen = max(plans, key=rank)
    candidates = [p.candidate() if isinstance(p, Plan) else p for p in searched]
    if problem.workload.lengths.caching is not None:
        candidates = [c.model_copy(update={"cached_share": cached_share(
            p, prefilled[0] if prefilled and p.prefill_dtype else problem)})
            if isinstance(p, Plan) else c for p, c in zip(searched, candidates, strict=True)]
    plan = chosen.model_copy(update={  # the profiles by whole path: read from anywhere
        "profile": str(Path(args.profile).resolve()), "profile_model": args.model or "",
        "dtype": problem.profile.dtype,
        "prefill_profile": str(Path(args.prefill_profile).resolve())
        if chosen.prefill_dtype else "",
        "intra_node_gbps": args.intra_bw, "inter_node_gbps": args.inter_bw,
        "candidates": candidates,
        "reason": f"distserve plan --mode {args.mode} --affinity {args.affinity}"})
    seconds = time.perf_counter() - start
    if len(searched) > 1:
        console.print(modes_table(candidates, plan))
    console.print(plan_table(plan, seconds))
    found = candidates[next(i for i, p in enumerate(searched) if p is chosen)].cached_share
    if found is not None:
        console.print(f"its instances' prefix caches find {found:.1%} of the prompt tokens at "
                      f"{plan.rate_rps} req/s (simulated)")
    if args.baseline_profile:
        base_problem = build_problem(args, parser, args.baseline_profile, args.rate)
        try:
            base = colocated_plan(base_problem)
        except NoFeasiblePlan as e:
            console.print(f"colocated baseline: {e}")
        else:
            ratio = plan.best_per_device_goodput_rps / base.best_per_device_goodput_rps
            console.print(f"best per-device goodput: {plan.candidate().label} "
                          f"{plan.best_per_device_goodput_rps:.3f} req/s, colocated baseline "
                          f"{base.best_per_device_goodput_rps:.3f} req/s: {ratio:.2f}x")
    if not meets_target(plan):
        print(f"distserve plan: warning: {no_placement_meets(plan)}; the plan "
              f"{'written ' if args.output else ''}is the best found, simulated attainment "
              f"{plan.predicted_attainment:.1%}: lower the rate, relax the objectives or add "
              "devices", file=sys.stderr)
    if args.output:
        try:
            Path(args.output).write_text(plan.model_dump_json(indent=2) + "\n")
        except OSError as e:
            parser.error(f"--output {args.output}: {e.strerror}")
    if args.json:
        print(plan.model_dump_json())
    return 0


def check_output(path: Path, parser: argparse.ArgumentParser) -> None:
    """Fail before the search, not after it, on a plan file that cannot be written."""
    if path.is_dir():
        parser.error(f"--output {path} is a directory: give a file path")
    if not path.parent.is_dir():
        parser.error(f"--output {path}: no such directory {path.parent}")
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        parser.error(f"--output {path}: not writable")


def report_infeasible(failed: list[ModeCandidate], as_json: bool) -> int:
    """Why no mode has a plan: on stderr, and with --json as the last line of stdout."""
    for mode in failed:
        print(f"distserve plan: no feasible plan: {mode.label}: {mode.error}", file=sys.stderr)
    if as_json:
        print(json.dumps({"feasible": False, "modes": [
            {"mode": m.label, "error": m.error} for m in failed]}))
    return 1
