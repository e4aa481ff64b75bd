"""`distserve bench`: SLO attainment and goodput of any OpenAI-compatible server under a
workload at a list of rates; `distserve bench compare`: disaggregated against colocated on
this machine, side by side; `distserve bench engine`: the engine against HF transformers.

Default SLOs scale unloaded latencies, measured first (one request at a time, the workload's
median prompt, 16 tokens): TTFT = --ttft-factor x unloaded TTFT, TPOT = --tpot-factor x
unloaded TPOT. Give --ttft and --tpot (seconds) to fix them instead."""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from distserve.bench import compare as cmp
from distserve.bench.loadgen import Target, served_model
from distserve.bench.plots import (
    Curve,
    plot_attainment_vs_rate,
    plot_attainment_vs_scale,
    plot_breakdown,
)
from distserve.bench.results import RunResult, goodput, met_everywhere
from distserve.bench.runner import Unloaded, calibrate, sweep, system_report
from distserve.bench.workload import BenchWorkload, Limits, parse_bench_workload
from distserve.commands import bench_engine
from distserve.commands.common import (
    existing_dir,
    non_negative_int,
    positive_float,
    positive_int,
)
from services.planner.modes import Candidate, best
from services.planner.profiles import (
    Profile,
    ProfileError,
    load_profile,
    measured_elsewhere,
    shipped_cpu_profile,
)
from shared.engine.config import WEIGHT_FORMATS
from shared.host import cpu_description
from shared.metrics import SLO, goodput_from_curve
from shared.workloads import WorkloadError

TTFT_FACTOR = 5.0
TPOT_FACTOR = 2.0
RATE_FACTORS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5)
QUICK_RATE_FACTORS = (0.25, 0.5, 0.75, 1.0)


def register(sub: Any) -> None:
    p = sub.add_parser("bench", help="goodput benchmarks (see: distserve bench --help)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="the server's base URL (default: %(default)s)")
    p.add_argument("--model", help="model name to request (default: the server's first)")
    p.add_argument("--api-key", help="bearer token, if the server wants one")
    p.add_argument("--devices", type=int, default=1,
                   help="devices the server uses, for per-device goodput (default: 1)")
    p.add_argument("--traces", type=existing_dir, help="a distserve run folder: latency breakdown "
                   "from its traces-*.jsonl")
    p.add_argument("--timeout", type=positive_float, default=300.0,
                   help="seconds before a request counts as failed (default: %(default)s)")
    _add_common(p)
    p.set_defaults(parser=p, run=run_bench)
    subs = p.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    bench_engine.register(subs)
    c = subs.add_parser("compare", help="disaggregated vs colocated on this machine",
                        description=cmp.__doc__)
    c.add_argument("--threads", type=non_negative_int, default=1, help="torch threads per worker")
    c.add_argument("--kv-cache-mb", type=positive_int, default=256,
                   help="KV pool per worker (MiB)")
    c.add_argument("--chunked", action="store_true",
                   help="also run colocated replicas with chunked prefill")
    c.add_argument("--weights", choices=list(WEIGHT_FORMATS), default="auto",
                   help="every worker's weight format (default: %(default)s, float32 on CPU)")
    c.add_argument("--decode-weights", choices=list(WEIGHT_FORMATS), default="",
                   help="the disaggregated decode instance's format (e.g. int4 beside a "
                        "float32 prefill instance); a colocated worker runs one format for "
                        "both phases, so colocated replicas then run in each of the two and "
                        "the ratio is taken against the better")
    c.add_argument("--prefill-dtype", choices=["bfloat16", "float16"], default="",
                   help="the disaggregated prefill instance's compute dtype (e.g. bfloat16, "
                        "on a CPU with bfloat16 dot products); colocated replicas then also "
                        "run in it, and the ratio is taken against the better")
    c.add_argument("--quick", action="store_true",
                   help="fewer rates and requests (4 rates of 16): about 12 minutes on 2 "
                        "cores for two systems, more with --chunked, --decode-weights and "
                        "rates past the grid")
    c.add_argument("--extend", type=int, default=3, metavar="N",
                   help="past the rate grid, run each system at up to N more rates (1.5x the "
                        "highest while it meets the attainment target at every rate, the "
                        "lowest / 1.5 while that one misses it) so that its goodput is "
                        "measured, not a lower bound; 0: the grid only (default: %(default)s)")
    c.add_argument("--simulate", action="store_true",
                   help="also simulate each system with the latency profile; prints measured "
                        "vs simulated attainment, and request by request the TTFT and TPOT "
                        "differences and the requests whose outcome differs")
    c.add_argument("--from", dest="recorded", type=Path, metavar="RESULTS_JSON",
                   help="start nothing: simulate the requests of an earlier run again (the "
                        "results.json it wrote; give its --workload) with --profile, and "
                        "report as --simulate does, on the run's objectives unless --ttft/"
                        "--tpot or a factor is given; writes --out")
    c.add_argument("--profile", type=Path, help="profile for --simulate (default: the shipped "
                   "profile for --threads measured on this CPU where one ships, else "
                   "profiles/smollm2-135m-cpu-<threads>thread(s).json)")
    _add_common(c)
    c.set_defaults(parser=c, run=run_compare)


def _add_common(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--workload", default="humaneval", help="humaneval, sharegpt:PATH, "
                   "azure:PATH, mooncake:PATH, chat:SYSTEM:USER:OUTPUT:TURNS[:ACTIVE] "
                   "(conversations) or fixed:PROMPT:OUTPUT (default: %(default)s)")
    w.add_argument("--rates", help="comma-separated request rates (req/s); default: around "
                   "the unloaded capacity")
    w.add_argument("--requests", type=int, help="requests per rate (default: 48; 16 with --quick)")
    w.add_argument("--cv", type=float, default=1.0,
                   help="arrival CV: 1 Poisson, else gamma (traces replay their own)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--max-prompt", type=int, default=1024, help="prompts cut to this")
    w.add_argument("--max-output", type=int, default=512, help="outputs cut to this")
    w.add_argument("--length-scale", type=positive_float, default=1.0,
                   help="multiply trace/synthetic lengths first (fit a trace to a small model)")
    s = p.add_argument_group("objectives")
    s.add_argument("--ttft", type=positive_float, help="TTFT objective, seconds")
    s.add_argument("--tpot", type=positive_float, help="TPOT objective, seconds")
    s.add_argument("--ttft-factor", type=positive_float,
                   help=f"default TTFT = this x unloaded TTFT (default: {TTFT_FACTOR})")
    s.add_argument("--tpot-factor", type=positive_float,
                   help=f"default TPOT = this x unloaded TPOT (default: {TPOT_FACTOR})")
    s.add_argument("--attainment", type=float, default=0.9,
                   help="target share of requests meeting both (default: %(default)s)")
    p.add_argument("--out", type=Path, help="results folder (default: runs/bench-<time>)")


def _setup(args: argparse.Namespace, parser: argparse.ArgumentParser) -> BenchWorkload:
    if args.requests is not None and args.requests < 1:
        parser.error("--requests must be at least 1")
    if not 0 < args.attainment <= 1:
        parser.error("--attainment must be in (0, 1]")
    if (args.ttft is None) != (args.tpot is None):
        parser.error("give both --ttft and --tpot, or neither (then they are calibrated)")
    if args.ttft is not None and min(args.ttft, args.tpot) <= 0:
        parser.error("--ttft and --tpot must be positive")
    if args.rates is not None:
        try:
            args.rates = [float(r) for r in args.rates.split(",")]
        except ValueError:
            parser.error(f"--rates takes comma-separated numbers, got {args.rates!r}")
        if not args.rates or min(args.rates) <= 0:
            parser.error("--rates must be positive")
    try:
        limits = Limits(args.max_prompt, args.max_output, args.length_scale)
        return parse_bench_workload(args.workload, limits, args.cv, args.seed)
    except WorkloadError as e:
        parser.error(str(e))


def _slo(args: argparse.Namespace, unloaded: Unloaded | None,
         recorded: SLO | None = None) -> SLO:
    """--ttft/--tpot, else each objective its factor given times `unloaded`'s latency; one
    with no factor given is `recorded`'s (`--from`: the run's own), else the default
    factor's."""
    if args.ttft is not None:
        return SLO(args.ttft, args.tpot)
    assert unloaded is not None, "calibrated when no SLO is given"
    base = recorded or unloaded.slo(TTFT_FACTOR, TPOT_FACTOR)
    return SLO(args.ttft_factor * unloaded.ttft_s if args.ttft_factor else base.ttft_s,
               args.tpot_factor * unloaded.tpot_s if args.tpot_factor else base.tpot_s)


def _out(args: argparse.Namespace) -> Path:
    out: Path = args.out or Path("runs") / f"bench-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    return out


def _mean_output(workload: BenchWorkload) -> float:
    return sum(i.output_tokens for i in workload.items) / len(workload.items)


def run_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    workload = _setup(args, parser)
    if args.devices < 1:
        parser.error("--devices must be at least 1")
    console = Console()
    try:
        model = args.model or asyncio.run(served_model(args.url, args.api_key))
    except (httpx.HTTPError, RuntimeError, KeyError) as e:
        parser.error(f"cannot reach a model at {args.url}/v1/models: {e}")
    target = Target(args.url, model, args.api_key, args.timeout)
    unloaded = None
    if args.ttft is None or args.rates is None:  # needed for default SLOs or rates
        try:
            unloaded = calibrate(target, workload)
        except RuntimeError as e:
            console.print(f"[red]distserve bench: {e}[/red]")
            return 1
        console.print(f"unloaded: TTFT {1e3 * unloaded.ttft_s:.1f} ms, TPOT "
                      f"{1e3 * unloaded.tpot_s:.1f} ms ({unloaded.prompt_tokens}-token prompt)")
    slo = _slo(args, unloaded)
    rates = args.rates
    if rates is None:
        assert unloaded is not None, "calibrated when no rates are given"
        rates = cmp.auto_rates(unloaded, _mean_output(workload), args.devices, RATE_FACTORS)
    runs = sweep(target, workload, rates, args.requests or 48, args.seed, model, args.traces)
    out = _out(args)
    curve = Curve(model, args.devices, runs)
    report = {"url": args.url, "workload": workload.name, "slo": slo.__dict__,
              "attainment_target": args.attainment,
              "unloaded": unloaded.__dict__ if unloaded else None,
              "systems": [system_report(model, args.devices, runs, slo, args.attainment)]}
    _finish(console, out, report, [curve], slo, args.attainment, workload.name)
    return 0 if all(r.failed == 0 for r in runs) else 1


def run_compare(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    workload = _setup(args, parser)
    if args.extend < 0:
        parser.error("--extend must be 0 or more")
    console = Console()
    recorded: dict[str, Any] = {}
    if args.recorded is not None:
        if args.rates is not None or args.requests is not None:
            parser.error("--from simulates the recorded runs' own rates and requests: "
                         "--rates and --requests do not go with it")
        try:
            recorded = json.loads(args.recorded.read_text())
            args.threads = int(recorded["threads_per_worker"])
            recorded_slo = SLO(**recorded["slo"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            parser.error(f"--from {args.recorded}: not a results.json of bench compare ({e})")
        if recorded.get("workload") != workload.name:
            parser.error(f"--from {args.recorded} ran the workload {recorded.get('workload')!r}:"
                         f" give the same --workload (and its options), not {workload.name!r}")
    profile = None
    if args.simulate or recorded:
        path = args.profile or shipped_cpu_profile(args.threads, cpu_description())
        try:
            profile = load_profile(path)
        except (ProfileError, FileNotFoundError) as e:
            parser.error(f"--simulate needs a profile for {args.threads} thread(s) per worker "
                         f"(distserve profile --threads {args.threads}): {e}")
        elsewhere = measured_elsewhere(profile, cpu_description())
        if elsewhere:
            console.print(f"[yellow]warning[/yellow]: {elsewhere}; the simulated figures "
                          "may be far off (distserve profile --threads "
                          f"{args.threads} -o FILE, then --profile FILE)")
        formats = {recorded.get("weights", args.weights),
                   recorded.get("decode_weights", args.decode_weights),
                   recorded.get("prefill_dtype", args.prefill_dtype)} - {"", "auto"}
        if formats:
            console.print(f"[yellow]warning[/yellow]: a profile prices one weight format and "
                          f"dtype; the {'/'.join(sorted(formats))} instances are simulated at "
                          "its step times (distserve profile --weights / --dtype ... for "
                          "theirs)")
    if recorded:
        try:
            measured = cmp.recorded(recorded)
        except (ValueError, KeyError, TypeError) as e:
            parser.error(f"--from {args.recorded}: {e}")
        if not measured:
            parser.error(f"--from {args.recorded}: no system was recorded")
        return _report_compare(args, console, workload, measured, list(recorded["rates"]),
                               _slo(args, measured[0].unloaded, recorded_slo), profile)
    requests = args.requests or (16 if args.quick else 48)
    grid = cmp.RateGrid(QUICK_RATE_FACTORS if args.quick else RATE_FACTORS,
                        _mean_output(workload), lambda unloaded: _slo(args, unloaded),
                        args.attainment, args.extend, list(args.rates or []))
    try:
        systems = cmp.systems(args.threads, args.kv_cache_mb, args.chunked, args.weights,
                              args.decode_weights, args.prefill_dtype,
                              prefix_caching=workload.shares_prefixes)
    except ValueError as e:  # a weight format and a dtype that cannot go together
        parser.error(str(e))
    measured = [cmp.measure(system, workload, grid, requests, args.seed,
                            cmp.default_run_root(), console.print) for system in systems]
    assert grid.slo is not None, "set by the first system's calibration"
    return _report_compare(args, console, workload, measured, grid.rates, grid.slo, profile)


def _report_compare(args: argparse.Namespace, console: Console, workload: BenchWorkload,
                    measured: Sequence[cmp.Measured], chosen: Sequence[float], slo: SLO,
                    profile: Profile | None) -> int:
    """The tables, plots and results.json of the systems measured (or recorded), with their
    simulation where there is a profile."""
    curves, fidelities, lives, caches = [], [], [], []
    for m in measured:
        simulated = raw = None
        if profile is not None:
            caches.append(cmp.cache_fits(m, profile, workload, slo))
            sims = cmp.simulate(m, profile, workload, slo)
            simulated = [sim.attainment(slo) for sim in sims]
            raw = [sim.attainment(slo) for sim in cmp.simulate(
                m, profile, workload, slo, calibrate=False)]
            fidelities.append([cmp.fidelity(run, sim, slo)
                               for run, sim in zip(m.runs, sims, strict=True)])
            lives.append(cmp.simulate_live(m, profile, workload, slo))
        curves.append(Curve(m.system.name, m.system.devices, m.runs, simulated, raw))
    reports = [system_report(c.name, c.devices, c.runs, slo, args.attainment) | {
        "cores_used": m.cores_used, "kv_link_bps": m.link_bps,
        "unloaded": m.unloaded.__dict__} for c, m in zip(curves, measured, strict=True)]
    for report, c, fits, live, cached in zip(reports, curves, fidelities, lives, caches,
                                             strict=False):
        if cached:  # each rate: the prefix cache model's tokens found against the stack's
            report["cache_model"] = [dataclasses.asdict(f) for f in cached]
        if c.simulated is not None:
            report["simulated_attainment"] = list(c.simulated)
            report["simulated_attainment_uncalibrated"] = list(c.simulated_raw or [])
            report["simulated_goodput_rps"] = _goodput_of(c.runs, c.simulated, args.attainment)
            report["fidelity"] = [f.to_json() for f in fits]
            # each rate simulated on the steps the stack ran at it (None: not recorded)
            report["simulated_attainment_live"] = [
                x.result.attainment(slo) if x else None for x in live]
            report["live_calibration"] = [x.live.to_json() if x else None for x in live]
            # the same with the steps' times drawn as they scattered: how they did, and
            # each draw's attainment (cmp.DRAWS of them; empty: too few steps to tell)
            report["live_noise"] = [dataclasses.asdict(x.live.noise) if x else None
                                    for x in live]
            report["simulated_attainment_live_draws"] = [list(x.draws) if x else None
                                                         for x in live]
            report["live_stages_s"] = [cmp.stages(run, x.result) if x else None
                                       for run, x in zip(c.runs, live, strict=True)]
    # the baseline: the better colocated system (one a weight format, with --decode-weights)
    baseline = max((i for i, m in enumerate(measured) if m.system.mode == "colocated"),
                   key=lambda i: reports[i]["per_device_goodput_rps"])
    ours, base = reports[0]["per_device_goodput_rps"], reports[baseline]["per_device_goodput_rps"]
    stack = measured[0].system.stack
    report = {"workload": workload.name, "slo": slo.__dict__, "threads_per_worker":
              args.threads, "kv_cache_mb": stack.kv_cache_mb, "weights": stack.weights,
              "decode_weights": stack.decode_weights, "prefill_dtype": stack.prefill_dtype,
              "prefix_caching": stack.prefix_caching, "attainment_target": args.attainment,
              "rates": list(chosen),
              "unloaded": measured[0].unloaded.__dict__, "systems": reports,
              "ratio_disaggregated_to_colocated": ours / base if base > 0 else None,
              "colocated_baseline": reports[baseline]["name"]}
    if profile is not None:
        found = cmp.recommend(measured[0], profile, workload, slo, args.attainment,
                              chosen[len(chosen) // 2])
        report["recommendation"] = recommendation(found, measured, reports)
    out = _out(args)
    _finish(console, out, report, curves, slo, args.attainment, workload.name)
    if profile is not None:
        _print_fidelity(console, curves, fidelities, lives, slo,
                        [r.get("live_stages_s") or [] for r in reports])
        _print_cache_fits(console, curves, caches)
        _print_recommendation(console, report["recommendation"])
    ratio = report["ratio_disaggregated_to_colocated"]
    if ratio is not None:
        bound = {(True, False): "at least ", (False, True): "at most ",
                 (True, True): "undetermined (both met the target at every rate; raise "
                               "--extend or --rates): "}.get(
            (reports[0]["goodput_lower_bound"], reports[baseline]["goodput_lower_bound"]), "")
        names = f"{reports[0]['name']} / {reports[baseline]['name']}"
        console.print(f"per-device goodput ratio, {names}: {bound}{ratio:.2f}x")
    else:
        lowest = min(run.rate for run in measured[baseline].runs)
        console.print(f"per-device goodput ratio: undefined, {reports[baseline]['name']} "
                      f"missed the target even at {lowest:g} req/s (give lower --rates)")
    return 0


def recommendation(found: Sequence[Candidate], measured: Sequence[cmp.Measured],
                   reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The planner's pick among the modes on these two devices, next to the measured
    ranking of the systems run (per-device goodput)."""
    chosen = best(found)
    named = sorted(((m.system.mode, r["per_device_goodput_rps"], m.system.name)
                    for m, r in zip(measured, reports, strict=True)), key=lambda x: -x[1])
    ranking = [(mode, g) for mode, g, _ in named]
    got = dict(reversed(ranking))  # a mode run twice (in two weight formats): its best
    top = ranking[0][1]
    return {"mode": chosen.mode,
            "simulated": [{"mode": c.mode, "layout": c.layout, "goodput_rps": c.goodput_rps,
                           "per_device_goodput_rps": c.per_device_rps,
                           "attainment_at_rate": c.attainment} for c in found],
            "measured_ranking": [{"mode": mode, "system": name, "per_device_goodput_rps": g}
                                 for mode, g, name in named],
            "recommended_vs_best_measured": got[chosen.mode] / top
            if chosen.mode in got and top > 0 else None}


def _print_cache_fits(console: Console, curves: Sequence[Curve],
                      caches: Sequence[Sequence[cmp.CacheFit]]) -> None:
    """Each system's prompt tokens found cached, measured against the prefix cache
    model's, rate by rate."""
    for c, fits in zip(curves, caches, strict=False):
        if fits:
            shares = ", ".join(f"{f.measured:.1%}/{f.modelled:.1%}" for f in fits)
            console.print(
                f"prefix caches of {c.name}, found measured/modelled at each rate: {shares}; "
                f"{sum(f.exact for f in fits)} of {sum(f.requests for f in fits)} requests "
                "as modelled to the token", markup=False)


def _print_recommendation(console: Console, rec: dict[str, Any]) -> None:
    simulated = ", ".join(f"{c['mode']} {c['per_device_goodput_rps']:.3f}"
                          for c in rec["simulated"])
    measured = ", ".join(f"{m.get('system', m['mode'])} {m['per_device_goodput_rps']:.3f}"
                         for m in rec["measured_ranking"])
    console.print(f"planner recommends: [bold]{rec['mode']}[/bold] (simulated per-device "
                  f"goodput: {simulated}); measured ranking: {measured}")
    ratio = rec["recommended_vs_best_measured"]
    if ratio is not None:
        console.print(f"the recommended mode measured {ratio:.2f}x the best measured")
    else:
        console.print("the recommended mode was not among the systems run (add --chunked), "
                      "or no system met the target at any rate")


def _goodput_of(runs: Sequence[RunResult], attained: Sequence[float], target: float) -> float:
    return goodput_from_curve([r.rate for r in runs], list(attained), target)


def _finish(console: Console, out: Path, report: dict[str, Any], curves: Sequence[Curve],
            slo: SLO, target: float, title: str) -> None:
    (out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    plot_attainment_vs_rate(curves, slo, target, out / "attainment_vs_rate.png", title)
    middle = len(curves[0].runs) // 2
    plot_attainment_vs_scale(curves, middle, slo, target, out / "attainment_vs_slo_scale.png",
                             title)
    plot_breakdown(curves, out / "breakdown.png", f"{title}: latency breakdown")
    for c in curves:
        _print_table(console, c, slo, target)
    console.print(f"wrote {out}/results.json and plots")


MAX_ERRORS_SHOWN = 3  # distinct reasons printed under a system's table


def _print_table(console: Console, curve: Curve, slo: SLO, target: float) -> None:
    best = goodput(curve.runs, slo, target)
    at_least = "at least " if met_everywhere(curve.runs, slo, target) else ""
    table = Table(title=f"{curve.name}: goodput {at_least}{best:.3f} req/s, "
                        f"{best / curve.devices:.3f} per device (TTFT {slo.ttft_s:.3g} s, "
                        f"TPOT {slo.tpot_s:.3g} s, target {target:.0%})")
    # the prompt share found in the prefix caches, where any was
    cached = any(r.cached_tokens for run in curve.runs for r in run.records)
    for column in ("rate", "done", "failed", "attain", "TTFT p50", "TTFT p90", "TPOT p50",
                   "TPOT p90", "tok/s", "tightest scale", *("cached",) * cached):
        table.add_column(column, justify="right")
    for run in curve.runs:
        s = run.summary(slo, target)
        table.add_row(f"{run.rate:g}", str(s["completed"]), str(s["failed"]),
                      f"{s['attainment']:.0%}", f"{s['ttft_s']['p50']:.3f}",
                      f"{s['ttft_s']['p90']:.3f}", f"{s['tpot_s']['p50']:.4f}",
                      f"{s['tpot_s']['p90']:.4f}", f"{s['output_tokens_per_s']:.1f}",
                      f"{s['tightest_slo_scale']:.2f}",
                      *(f"{s['cached_share']:.1%}",) * cached)
    console.print(table)
    errors = collections.Counter(r.error for run in curve.runs for r in run.records if r.error)
    for error, times in errors.most_common(MAX_ERRORS_SHOWN):  # why requests failed
        console.print(f"[red]{curve.name}: {times} request{'s' * (times > 1)} failed: "
                      f"{escape(error)}[/red]")
    if len(errors) > MAX_ERRORS_SHOWN:
        console.print(f"[red]{curve.name}: {len(errors) - MAX_ERRORS_SHOWN} other errors "
                      "(results.json has every request's)[/red]")


def _print_fidelity(console: Console, curves: Sequence[Curve],
                    fidelities: Sequence[Sequence[cmp.Fidelity]],
                    lives: Sequence[Sequence[cmp.LiveRun | None]],
                    slo: SLO, live_stages: Sequence[Sequence[dict[str, Any] | None]]) -> None:
    table = Table(title="measured vs simulated attainment (simulated: profile calibrated to "
                        "the measured unloaded latencies; raw: the profile as fitted; live: "
                        "calibrated to the engine steps the stack ran at that rate, as the "
                        "online planner calibrates, on the steps that ran alone, with the "
                        "contention of those beside another instance's; scattered: the same, "
                        f"{cmp.DRAWS} times with the steps' times drawn as the stack's "
                        "scattered around that fit, mean and 10th-90th percentile), and "
                        "request by request: median measured "
                        "- simulated TTFT and TPOT, requests whose outcome differs (near: "
                        "within 5% of both objectives)")
    for column in ("system", "rate", "measured", "simulated", "difference", "raw",
                   "raw difference", "live", "live difference", "scattered",
                   "live steps x profile",
                   "TTFT diff", "TPOT diff", "differ (near)"):
        table.add_column(column, justify="right")
    gaps: dict[str, list[float]] = {"simulated": [], "live": [], "scattered": []}
    inside = []  # whether the measured attainment lies within the draws' p10-p90
    outside = []  # the rates where it does not, said with their steps' noise
    for c, found, live in zip(curves, fidelities, lives, strict=False):
        for run, sim, raw, f, x in zip(c.runs, c.simulated or [], c.simulated_raw or [], found,
                                       live, strict=False):
            got = run.attainment(slo)
            gaps["simulated"].append(sim - got)
            cells = ["-", "-", "-", "-"]
            if x is not None:
                gaps["live"].append(x.result.attainment(slo) - got)
                band = x.band()
                scattered = "-"
                if band is not None:
                    low, mean, high = band
                    gaps["scattered"].append(mean - got)
                    inside.append(low - 1e-9 <= got <= high + 1e-9)
                    scattered = f"{mean:.0%} ({low:.0%}-{high:.0%})"
                    if not inside[-1]:
                        outside.append(f"{c.name} at {run.rate:g} req/s: measured {got:.0%}, "
                                       f"band {low:.0%}-{high:.0%}; its steps against their "
                                       f"fit: {x.live.describe_noise()}")
                cells = [f"{x.result.attainment(slo):.0%}", f"{100 * gaps['live'][-1]:+.1f}",
                         scattered, x.live.describe()]
            table.add_row(c.name, f"{run.rate:g}", f"{got:.0%}", f"{sim:.0%}",
                          f"{100 * (sim - got):+.1f}", f"{raw:.0%}", f"{100 * (raw - got):+.1f}",
                          *cells, f"{f.ttft_s:+.3f} s", f"{1e3 * f.tpot_s:+.1f} ms",
                          f"{f.differ} ({f.near})")
    console.print(table)
    console.print("within 5 points: " + "; ".join(
        f"{name} {sum(abs(g) <= 0.05 + 1e-9 for g in found)} of {len(found)}"
        for name, found in gaps.items() if found) + (
        f"; measured within the scattered 10th-90th percentiles {sum(inside)} of "
        f"{len(inside)}" if inside else ""))
    for line in outside:
        console.print(f"  outside the band: {escape(line)}")
    staged = [(c.name, run.rate, f.stages_s, lived or {})
              for c, found, lived_runs in zip(curves, fidelities, live_stages, strict=False)
              for run, f, lived in zip(c.runs, found, lived_runs, strict=False) if f.stages_s]
    if not staged:
        return
    names = list(cmp.SIMULATED_STAGES)
    table = Table(title="where a request's time goes, measured (the services' spans) / "
                        "simulated / live: mean ms a request")
    for column in ("system", "rate", *names):
        table.add_column(column, justify="right")
    for name, rate, stages, lived in staged:
        table.add_row(name, f"{rate:g}", *(" / ".join(
            [f"{1e3 * stages[s][0]:.0f}", f"{1e3 * stages[s][1]:.0f}"] +
            ([f"{1e3 * lived[s][1]:.0f}"] if s in lived else [])) if s in stages else "-"
            for s in names))
    console.print(table)
