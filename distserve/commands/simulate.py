"""`distserve simulate`: a plan's simulated attainment, latencies and breakdown, or with
--sweep its attainment-versus-rate curve next to the colocated baseline's."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from distserve.commands.common import (
    first_error,
    non_negative_int,
    positive_float,
    positive_floats,
    positive_int,
)
from distserve.commands.workload_arg import WORKLOAD_HELP, add_context_args, parse_workload
from services.planner.baseline import colocated_plan
from services.planner.models import UnknownModelError
from services.planner.placement import NoFeasiblePlan, Problem
from services.planner.plan import Plan, named_file
from services.planner.plan_sim import colocated_on_same_devices, simulate_plan
from services.planner.profiles import (
    Profile,
    ProfileError,
    kv_capacity_tokens,
    load_profile,
    with_prefill_of,
)
from services.planner.simulator import SimResult
from shared.metrics import SLO, goodput_from_curve, percentiles
from shared.workloads import Workload, WorkloadError


def register(sub: Any) -> None:
    p = sub.add_parser("simulate", help="simulate a plan (or sweep rates)",
                       description=__doc__)
    p.add_argument("--plan", required=True, type=Path, help="plan JSON from distserve plan -o")
    p.add_argument("--workload", required=True,
                   help=WORKLOAD_HELP)
    p.add_argument("--rate", type=positive_float,
                   help="request rate (req/s); default: the plan's")
    p.add_argument("--cv", type=positive_float, default=1.0, help="arrival CV (1 = Poisson)")
    add_context_args(p)
    p.add_argument("--requests", type=positive_int, default=2000,
                   help="requests per simulation")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--sweep", action="store_true",
                   help="attainment versus rate, with the colocated baseline")
    p.add_argument("--rates", type=positive_floats, help="comma-separated rates for --sweep "
                   "(default: 0.25x..2x the plan's rate)")
    p.add_argument("--baseline-profile", help="profile of the colocated baseline (default: "
                   "the plan's profile)")
    p.add_argument("--out", type=Path, default=Path("runs/sweep"), help="--sweep output folder")
    p.set_defaults(parser=p, run=run)


def _load(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[Plan, Profile,
                                                                             Workload]:
    try:
        plan = Plan.model_validate_json(args.plan.read_text())
        profile = load_profile(named_file(args.plan, plan.profile), plan.profile_model or None)
        if plan.prefill_profile:  # its prefill instances priced as they were planned
            try:
                prefiller = load_profile(named_file(args.plan, plan.prefill_profile),
                                         plan.profile_model or None)
            except ProfileError as e:
                raise ProfileError(f"the plan's prefill_profile: {e} (a relative path is "
                                   "read from the working folder, else beside the plan)") from e
            profile = with_prefill_of(profile, prefiller)
        workload = parse_workload(args.workload, args.cv, max_context=args.max_context,
                                  fit=args.fit, prefix_cache=args.prefix_cache)
    except FileNotFoundError as e:
        parser.error(f"no such file: {e.filename}")
    except OSError as e:
        parser.error(f"cannot read {e.filename}: {e.strerror}")
    except UnicodeDecodeError:
        parser.error(f"{args.plan} is not a plan: not UTF-8 text")
    except ValidationError as e:
        parser.error(f"{args.plan} is not a plan: {first_error(e)}")
    except (ProfileError, UnknownModelError, WorkloadError) as e:
        parser.error(str(e))
    problem = plan_error(plan) or instance_error(plan, profile)
    if problem:
        parser.error(f"{args.plan}: {problem}")
    return plan, profile, workload


def plan_error(plan: Plan) -> str:
    """What in a (hand-edited) plan's objectives or size the simulator cannot run, or ''."""
    if not all(math.isfinite(v) and v > 0 for v in (plan.ttft_s, plan.tpot_s)):
        return f"ttft_s and tpot_s must be positive, got {plan.ttft_s} and {plan.tpot_s}"
    if not 0 < plan.attainment_target <= 1:
        return f"attainment_target must be in (0, 1], got {plan.attainment_target}"
    if not plan.devices_used > 0:
        return f"devices_used must be positive, got {plan.devices_used}"
    if not min(plan.intra_node_gbps, plan.inter_node_gbps) > 0:
        return "intra_node_gbps and inter_node_gbps must be positive"
    if not plan.instances:
        return "it has no instances"
    roles = {i.role for i in plan.instances}
    needed = {"prefill", "decode"} if plan.mode == "disaggregated" else {"colocated"}
    if roles != needed:
        return (f"a {plan.mode} plan has instances of role {' and '.join(sorted(needed))}"
                f", this one {' and '.join(sorted(roles))}")
    return ""


def instance_error(plan: Plan, profile: Profile) -> str:
    """Which instance of the plan its profile cannot price, or ''."""
    for n, i in enumerate(plan.instances):
        if i.tp not in profile.by_tp or i.pp < 1:
            return (f"instances[{n}] ({i.role} tp {i.tp} pp {i.pp}) is not a configuration "
                    f"of its profile (tp {profile.tps}, pp 1 or more)")
        if not i.devices:
            return f"instances[{n}] ({i.role}) has no devices"
        if kv_capacity_tokens(profile, i.tp, i.pp) <= 0:
            return (f"instances[{n}] ({i.role} tp {i.tp} pp {i.pp}): the profile has no KV "
                    "capacity for it")
    return ""


def summary(result: SimResult, slo: SLO) -> dict[str, Any]:
    ttfts = [r.ttft for r in result.requests if r.ttft is not None]
    tpots = [r.tpot for r in result.requests if r.tpot is not None]
    return {"attainment": result.attainment(slo), "ttft_s": percentiles(ttfts),
            "tpot_s": percentiles(tpots), "breakdown_s": result.breakdown(),
            "completed": len(ttfts), "requests": len(result.requests),
            "cached_share": result.cached_share}


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    plan, profile, workload = _load(args, parser)
    slo = SLO(plan.ttft_s, plan.tpot_s)
    if args.sweep:
        return sweep(args, parser, plan, profile, workload, slo)
    rate = args.rate if args.rate is not None else plan.rate_rps
    if not (math.isfinite(rate) and rate > 0):
        parser.error(f"{args.plan}: the plan's rate_rps {rate} is not positive: give --rate")
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
    if workload.lengths.caching is not None:
        print(f"the instances' prefix caches found {stats['cached_share']:.1%} of the prompt "
              "tokens")
    return 0


def sweep(args: argparse.Namespace, parser: argparse.ArgumentParser, plan: Plan,
          profile: Profile, workload: Workload, slo: SLO) -> int:
    if not (math.isfinite(plan.rate_rps) and plan.rate_rps > 0):
        parser.error(f"{args.plan}: the plan's rate_rps {plan.rate_rps} is not positive")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} is a file: give a folder")
    rates = args.rates or [plan.rate_rps * f for f in (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)]
    try:
        base_profile = load_profile(args.baseline_profile or named_file(args.plan, plan.profile),
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
        lower_bound = min(attained) >= plan.attainment_target
        curves[name] = {"rates": rates, "attainment": attained, "devices": p.devices_used,
                        "goodput_rps": goodput, "per_device_goodput_rps":
                            goodput / p.devices_used, "goodput_lower_bound": lower_bound}
        print(f"{name:>13} ({p.devices_used} devices): "
              + goodput_text(goodput, p.devices_used, lower_bound, min(rates)))
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        parser.error(f"--out {args.out}: {e.strerror}")
    (args.out / "sweep.json").write_text(json.dumps(curves, indent=2) + "\n")
    plot_sweep(curves, plan.attainment_target, args.out / "sweep.png",
               f"{plan.model}: TTFT {slo.ttft_s}s, TPOT {slo.tpot_s}s")
    print(f"wrote {args.out / 'sweep.json'} and {args.out / 'sweep.png'}")
    return 0


def goodput_text(goodput: float, devices: int, lower_bound: bool, lowest: float) -> str:
    """The goodput of a swept curve as far as the rates swept tell it."""
    if lower_bound:
        return (f"goodput at least {goodput:.2f} req/s (the highest rate swept), "
                f"{goodput / devices:.3f} per device: sweep higher --rates")
    if goodput == 0:
        return f"goodput below {lowest:g} req/s (the lowest rate swept misses the target)"
    return f"goodput {goodput:.2f} req/s, {goodput / devices:.3f} per device"


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
