"""Two disaggregated stacks, one prefilling in float32 and one in `--prefill-dtype`, brought up
in turn round after round at the same rates, objectives and requests, so that this host's
drift hits both alike: per round, each stack's attainment and TPOT median at each rate, and
its decode instance's median step time by batch size (the steps the workers reported).

    .venv/bin/python benchmarks/stack_ab.py --workload humaneval --rates 2.469,3.704 \
        --ttft 0.793 --tpot 0.0269 --rounds 3 --requests 48

One `bench compare` run measures each system once, and near a system's knee one run does not
repeat (docs/benchmarks.md); this says whether a difference outlasts the rounds. About 1.3
minutes a stack for two rates of 48 requests on 2 cores.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

import distserve.bench.compare as cmp
from distserve.bench.results import RunResult
from distserve.bench.workload import Limits, parse_bench_workload
from shared.engine.config import DTYPE_NAMES
from shared.metrics import SLO

BATCHES = (1, 2, 4, 8)  # decode steps grouped by batch: 1, 2-3, 4-7, 8 and more


def decode_steps(run: RunResult) -> str:
    """The decode instances' median step (ms) at each batch group, and how many steps."""
    groups: dict[int, list[float]] = defaultdict(list)
    for worker, samples in run.steps.items():
        if worker.startswith("decode"):
            for s in samples:
                if s.batch and not s.prompts:
                    groups[max(b for b in BATCHES if b <= s.batch)].append(1e3 * s.seconds)
    return " ".join(f"b{b}+ {statistics.median(ms):.1f} ms ({len(ms)})"
                    for b, ms in sorted(groups.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="humaneval")
    parser.add_argument("--rates", required=True, help="comma-separated req/s, each stack runs "
                        "all of them in turn")
    parser.add_argument("--ttft", type=float, required=True, help="seconds")
    parser.add_argument("--tpot", type=float, required=True, help="seconds")
    parser.add_argument("--prefill-dtype", default="bfloat16", choices=list(DTYPE_NAMES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=48, help="requests a rate")
    parser.add_argument("--threads", type=int, default=1, help="torch threads a worker")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/stack-ab"))
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    workload = parse_bench_workload(args.workload, Limits(), 1.0, args.seed)
    slo = SLO(args.ttft, args.tpot)
    args.out.mkdir(parents=True, exist_ok=True)
    attained: dict[tuple[str, float], list[float]] = defaultdict(list)
    for i in range(args.rounds):
        for dtype in ("float32", args.prefill_dtype):
            system = cmp.systems(args.threads, 256, False, prefill_dtype=dtype)[0]
            grid = cmp.RateGrid((), 0.0, lambda _: slo, 0.9, 0, list(rates), slo)
            measured = cmp.measure(system, workload, grid, args.requests, args.seed, args.out,
                                   lambda _: None)
            for run in measured.runs:
                tpots = [r.tpot for r in run.records if r.tpot is not None]
                attained[dtype, run.rate].append(100 * run.attainment(slo))
                tpot = f"{1e3 * statistics.median(tpots):.1f} ms" if tpots else "none"
                print(f"round {i + 1}, prefill {dtype:8s} at {run.rate:g} req/s: "
                      f"{attained[dtype, run.rate][-1]:3.0f}% attained, TPOT p50 {tpot}; "
                      f"decode steps {decode_steps(run)}", flush=True)
    for rate in rates:
        print(f"{rate:g} req/s, attainment by round: " + "; ".join(
            f"prefill {dtype} " + " / ".join(f"{a:.0f}" for a in attained[dtype, rate])
            for dtype in ("float32", args.prefill_dtype)))


if __name__ == "__main__":
    main()
