"""`distserve simulate`: a plan's simulated attainment, latencies and breakdown, or with
--sweep its attainment-versus-rate curve next to the colocated baseline's."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from distserve.commands.workload_arg import WORKLOAD_HELP, add_context_args, parse_workload
from services.planner.baseline import colocated_plan
from services.planner.models import UnknownModelError
from services.planner.placement import NoFeasiblePlan, Problem
from services.planner.plan import Plan
from services.planner.plan_sim import colocated_on_same_devices, simulate_plan
from services.planner.profiles import Profile, ProfileError, load_profile, with_prefill_of
from services.planner.simulator import SimResult
from shared.metrics import SLO, goodput_from_curve, percentiles
from shared.workloads import Workload, WorkloadError


def register(sub: Any) -> None:
    p = sub.add_parser("simulate", help="simulate a plan (or sweep rates)",
                       description=__doc__)
    p.add_argument("--plan", required=True, type=Path, help="plan JSON from distserve plan -o")
    p.add_argument("--workload", required=True,
                   help=WORKLOAD_HELP)
    p.add_argument("--rate", type=float, help="request rate (req/s); default: the plan's")
    p.add_argument("--cv", type=float, default=1.0, help="arrival CV (1 = Poisson)")
    add_context_args(p)
    p.add_argument("--requests", type=int, default=2000, help="requests per simulation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sweep", action="store_true",
                   help="attainment versus rate, with the colocated baseline")
    p.add_argument("--rates", help="comma-separated rates for --sweep (default: 0.25x..2x the "
                   "plan's rate)")
    p.add_argument("--baseline-profile", help="profile of the colocated baseline (default: "
                   "the plan's profile)")
    p.add_argument("--out", type=Path, default=Path("runs/sweep"), help="--sweep output folder")
    p.set_defaults(parser=p, run=run)


def _load(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[Plan, Profile,
                                                                             Workload]:
    try:
        plan = Plan.model_validate_json(args.plan.read_text())
        profile = load_profile(plan.profile, plan.profile_model or None)
        if plan.prefill_profile:  # its prefill instances priced as they were planned
            try:
                prefiller = load_profile(plan.prefill_profile, plan.profile_model or None)
            except ProfileError as e:
                raise ProfileError(f"the plan's prefill_profile: {e} (a path is read from "
                                   "the directory you run in)") from e
            profile = with_prefill_of(profile, prefiller)
        workload = parse_workload(args.workload, args.cv, max_context=args.max_context,
                                  fit=args.fit)
    except FileNotFoundError as e:
        parser.error(f"no such file: {e.filename}")
    except ValidationError as e:
        parser.error(f"{args.plan} is not a plan: {e.errors()[0]['msg']}")
    except (ProfileError, UnknownModelError, WorkloadError) as e:
        parser.error(str(e))
    return plan, profile, workload


def summary(result: SimResult, slo: SLO) -> dict[str, Any]:
    ttfts = [r.ttft for r in result.requests if r.ttft is not None]
    tpots = [r.tpot for r in result.requests if r.tpot is not None]
    return {"attainment": result.attainment(slo), "ttft_s": percentiles(ttfts),
            "tpot_s": percentiles(tpots), "breakdown_s": result.breakdown(),
            "completed": len(ttfts), "requests": len(result.requests)}


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    plan, profile, workload = _load(args, parser)
    slo = SLO(plan.ttft_s, plan.tpot_s)
    if args.sweep:
        return sweep(args, parser, plan, profile, workload, slo)
    rate = args.rate or plan.rate_rps
    if rate <= 0:
        parser.error("--rate must be positive")
    stats = summary(simulate_plan(plan, profile, workload.requests(rate, args.requests,
                                                                    args.seed)), slo)
    table = Table(title=f"{plan.mode} plan at {rate} req/s: attainment "
                        f"{stats['attainment']:.1%} (TTFT {slo.ttft_s}s, TPOT {slo.tpot_s}s)")
    for column in ("", "p50", "p90", "p99"):
        table.add_column(column, justify="right")
    for name in ("ttft_s", "tpot_s"):
        table.add_row(name, *(f"{v:.4f}" for v in stats[name].values()))
    Console().print(table)
    for phase, seconds in stats["breakdown_s"].items():
        print(f"  {phase:>14}: {seconds:.4f} s mean")
    return 0


def sweep(args: argparse.Namespace, parser: argparse.ArgumentParser, plan: Plan,
          profile: Profile, workload: Workload, slo: SLO) -> int:
    rates = ([float(r) for r in args.rates.split(",")] if args.rates
             else [plan.rate_rps * f for f in (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)])
    try:
        base_profile = load_profile(args.baseline_profile or plan.profile,
                                    plan.profile_model or None)
        problem = Problem(base_profile, workload, slo, plan.rate_rps, plan.nodes,
                          plan.gpus_per_node, plan.attainment_target, seed=args.seed)
        baseline = colocated_on_same_devices(plan, colocated_plan(problem))
    except (ProfileError, NoFeasiblePlan) as e:
        print(f"distserve simulate: colocated baseline: {e}", file=sys.stderr)
        return 1
    curves: dict[str, Any] = {}
    for name, p, prof in ((plan.mode, plan, profile), ("colocated baseline", baseline,
                                                       base_profile)):
        attained = [simulate_plan(p, prof, workload.requests(r, args.requests, args.seed))
                    .attainment(slo) for r in rates]
        goodput = goodput_from_curve(rates, attained, plan.attainment_target)
        curves[name] = {"rates": rates, "attainment": attained, "devices": p.devices_used,
                        "goodput_rps": goodput, "per_device_goodput_rps":
                            goodput / p.devices_used}
        print(f"{name:>13} ({p.devices_used} devices): goodput {goodput:.2f} req/s, "
              f"{goodput / p.devices_used:.3f} per device")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sweep.json").write_text(json.dumps(curves, indent=2) + "\n")
    plot_sweep(curves, plan.attainment_target, args.out / "sweep.png",
               f"{plan.model}: TTFT {slo.ttft_s}s, TPOT {slo.tpot_s}s")
    print(f"wrote {args.out / 'sweep.json'} and {args.out / 'sweep.png'}")
    return 0


def plot_sweep(curves: dict[str, Any], target: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, c in curves.items():
        per_device = [r / c["devices"] for r in c["rates"]]
        ax.plot(per_device, [100 * a for a in c["attainment"]], marker="o", label=name)
    ax.axhline(100 * target, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("rate per device (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
