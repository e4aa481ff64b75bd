"""`distserve profile`: fit the latency model of this engine on this device."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress, TimeElapsedColumn

from distserve.commands.common import add_engine_args, engine_config, positive_int
from services.planner.latency import PhaseCoefficients
from services.planner.profiles import save_profile
from services.planner.profiling import Grid, enough_cores_for_contention, profile_engine
from shared.engine.meta import read_config


def register(sub: Any) -> None:
    p = sub.add_parser("profile", help="profile the engine and fit the latency model",
                       description="Run the engine over prefill and decode grids, fit the "
                                   "paper's latency model (Appendix A) and write a profile.")
    p.add_argument("--tp", dest="tps", type=positive_int, nargs="+", default=[1],
                   help="tensor parallelism: profile each of these (an instance of that many "
                        "ranks, the threads split between them) into one profile, for the "
                        "planner to weigh (default: 1)")
    p.add_argument("--pp", dest="pps", type=positive_int, nargs="+", default=[1],
                   help="pipeline stages: also profile each tp as a pipeline of each of these "
                        "(ranks of tp x pp), measured as the engine runs it (a prompt batch's "
                        "latency through the stages, a decode round of micro-batches); the "
                        "online planner weighs only the pipelines a profile measured "
                        "(default: 1, none)")
    p.add_argument("--quick", action="store_true", help="a smaller grid (about a minute)")
    p.add_argument("--no-contention", action="store_true",
                   help="on a CPU, skip measuring how steps slow beside a second engine (the "
                        "simulator's contention between devices of one host; about a minute, "
                        "tp 1 only, where the host has cores for two engines)")
    p.add_argument("--output", "-o", type=Path, help="profile file to write "
                   "(default: profiles/<model>-<device>.json, -<dtype> before .json where "
                   "not float32)")
    add_engine_args(p, tp=False)
    p.set_defaults(parser=p, run=run, kv_cache_mb=2048)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    console = Console()
    profiles = []
    try:  # the points the model's context holds (the tiny shape's 512 tokens: not all)
        grid = (Grid.quick() if args.quick else Grid()).within(
            read_config(args.model).max_context)
    except ValueError as e:
        parser.error(str(e))
    contention = not args.no_contention and enough_cores_for_contention(args.threads)
    started = time.monotonic()
    with Progress(*Progress.get_default_columns(), TimeElapsedColumn(), console=console,
                  transient=True) as bar:
        shapes = [(tp, pp) for tp in args.tps for pp in sorted({1, *args.pps})]
        total = sum(grid.points_for(pipelined=pp > 1) for _, pp in shapes)
        task = bar.add_task("profiling", total=total + 3 * contention)
        done = itertools.count()
        for tp, pp in shapes:
            def progress(what: str, name: str = shape_name(tp, pp)) -> None:
                bar.update(task, completed=next(done), description=f"{name}: {what}")
                if not console.is_terminal:  # a log gets a line a point instead of a bar
                    console.print(f"[{time.monotonic() - started:5.0f} s] {name}: {what}")

            try:
                profiles.append(profile_engine(
                    dataclasses.replace(engine_config(args), tp=tp, pp=pp), grid, progress,
                    contention and (tp, pp) == (1, 1)))
            except ValueError as e:
                parser.error(str(e))
    profile = dataclasses.replace(
        profiles[0], by_tp={tp: co for p in profiles for tp, co in p.by_tp.items()},
        pipelines={shape: co for p in profiles for shape, co in p.pipelines.items()})
    dtype = "" if profile.dtype in ("", "float32") else f"-{profile.dtype}"
    out = args.output or Path("profiles") / f"{profile.model.name}-{profile.device}{dtype}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    save_profile(profile, out)
    for tp, co in sorted(profile.by_tp.items()):
        console.print(f"tp {tp}:")
        print_coefficients(console, co)
    for (tp, pp), co in sorted(profile.pipelines.items()):
        console.print(f"tp {tp} pp {pp} (a prompt batch's latency; a decode round):")
        print_coefficients(console, co)
        if co.prefill_stage:
            console.print(f"  a stage is busy {co.prefill_stage:.3f} of a prompt's latency "
                          f"(an even split: {1 / pp:.3f})")
    for (tp, pp), measured in zip(shapes, profiles, strict=True):
        errors = ", ".join(f"{phase} {measured.fit[f'{phase}_heldout_median_rel_err']:.1%}"
                           for phase in ("prefill", "decode"))
        console.print(f"{shape_name(tp, pp)}: held-out median error {errors}")
    for key, value in profile.fit.items():
        console.print(f"  {key}: {value:.3f}")
    c = profile.contention
    if not c.none:
        console.print(f"beside a second engine: decode steps {c.decode_by_decode:.2f}x as "
                      f"long beside decodes, {c.decode_by_prefill:.2f}x beside prefills; "
                      f"prefill {c.prefill_by_decode:.2f}x and {c.prefill_by_prefill:.2f}x")
    console.print(f"L_m = {profile.l_m} tokens; wrote {out}")
    return 0


def shape_name(tp: int, pp: int) -> str:
    """'tp 1', 'tp 1 pp 2': how progress lines and the summary name a profiled shape."""
    return f"tp {tp}" + (f" pp {pp}" if pp > 1 else "")


def print_coefficients(console: Console, co: PhaseCoefficients) -> None:
    console.print(f"prefill ms = {co.prefill[0]:.3f} + {co.prefill[1]:.4g}*sum(l) + "
                  f"{co.prefill[2]:.3g}*sum(l^2)")
    if co.prefill_cached is not None:
        times_c = (f" ({co.prefill_cached / co.prefill[2]:.1f}x the quadratic term)"
                   if co.prefill[2] > 0 else "")
        console.print(f"  a chunk continuing a prompt: + {co.prefill_cached:.3g}"
                      f"*sum(l*cached){times_c}")
    for label, (a, b, c) in (("decode ms (B small)", co.decode_small),
                             ("decode ms (B large)", co.decode_large)):
        console.print(f"{label} = {a:.3f} + {b:.4g}*sum(ctx) + {c:.4g}*B")
    if co.decode_threshold < 1 << 30:
        console.print(f"  large-batch regime from B = {co.decode_threshold}")
