"""What pricing contention costs the simulator: the same requests simulated on a CPU profile
with its contention factors (every step on a host priced again whenever a neighbour's step
starts or ends: `core.Host`) and with them dropped (each step scheduled once), side by side,
interleaved, best of `--repeats`. The planner's search runs thousands of these.

    .venv/bin/python benchmarks/simulator_speed.py [--requests 4000] [--rate 1.0]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from collections.abc import Callable

from rich.console import Console
from rich.table import Table

from services.planner.latency import Contention
from services.planner.profiles import Profile, load_profile, shipped_cpu_profile
from services.planner.simulator import (
    ColocatedCluster,
    DisaggregatedCluster,
    InstanceSpec,
    Link,
    simulate_colocated,
    simulate_disaggregated,
)
from shared.host import cpu_description
from shared.workloads import Workload, WorkloadRequest, fixed_lengths


def best_ms(runs: list[Callable[[], object]], repeats: int) -> list[float]:
    """Each of `runs` timed `repeats` times, in turns; the best of each, ms."""
    best = [float("inf")] * len(runs)
    for _ in range(repeats):
        for i, run in enumerate(runs):
            started = time.perf_counter()
            run()
            best[i] = min(best[i], 1e3 * (time.perf_counter() - started))
    return best


def clusters(profile: Profile, requests: list[WorkloadRequest]
             ) -> dict[str, Callable[[InstanceSpec], object]]:
    link = Link(profile.model.kv_bytes_per_token)
    return {
        "colocated x2, one host": lambda spec: simulate_colocated(
            ColocatedCluster([spec, spec]), requests),
        "1 prefill + 1 decode, one host": lambda spec: simulate_disaggregated(
            DisaggregatedCluster([spec], [spec], link), requests)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    path = shipped_cpu_profile(1, cpu_description())
    profile = load_profile(path)
    requests = Workload(fixed_lengths(512, 32)).requests(args.rate, args.requests, seed=1)
    specs = [InstanceSpec(dataclasses.replace(profile.latency(1, 1), contention=c), 10**6, 2048)
             for c in (profile.contention, Contention())]
    table = Table(title=f"{args.requests} fixed:512:32 requests at {args.rate} req/s on "
                        f"{path.name}: ms a simulation (best of {args.repeats})")
    for column in ("cluster", "with contention", "without", "ratio"):
        table.add_column(column, justify="left" if column == "cluster" else "right")
    for name, simulate in clusters(profile, requests).items():
        ms = best_ms([functools.partial(simulate, spec) for spec in specs], args.repeats)
        table.add_row(name, f"{ms[0]:.0f}", f"{ms[1]:.0f}", f"{ms[0] / ms[1]:.2f}x")
    Console().print(table)
    print(f"the profile's contention: {profile.contention}")


if __name__ == "__main__":
    main()
