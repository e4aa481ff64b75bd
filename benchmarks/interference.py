"""How much one engine slows another on this host: one process's decode step and 512-token
prefill, beside a second engine process that is idle, decoding or prefilling, 1 thread
each, in interleaved rounds so drift hits every side alike.

    .venv/bin/python benchmarks/interference.py [--rounds 3] [--steps 100] [--prefills 4]

The measurement is `distserve profile`'s (services/planner/profiling.py: the contention
factors a CPU profile carries); this prints its step times and each round's ratios side by
side. On a GPU, a prefill instance and a decode instance on separate GPUs do not share
compute or memory bandwidth. Two cores of one CPU socket share the last-level cache and the
memory bus, so "separate devices" here still interfere; this measures by how much.
"""

from __future__ import annotations

import argparse
import statistics

from services.planner.profiling import NEIGHBOUR_MODES, contention_medians
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100, help="decode steps a phase")
    parser.add_argument("--prefills", type=int, default=4, help="prefills a phase")
    args = parser.parse_args()
    config = EngineConfig(threads=1)
    engine = Engine(config)
    rounds = []
    try:
        for i in range(args.rounds):
            rounds.append(contention_medians(engine, config, args.steps, args.prefills))
            decode = [rounds[-1][m][0] / rounds[-1]["idle"][0] for m in NEIGHBOUR_MODES]
            prefill = [rounds[-1][m][1] / rounds[-1]["idle"][1] for m in NEIGHBOUR_MODES]
            print(f"round {i + 1}: decode beside a neighbour decoding {decode[1]:.2f}x, "
                  f"prefilling {decode[2]:.2f}x; prefill {prefill[1]:.2f}x, {prefill[2]:.2f}x")
    finally:
        engine.close()
    med = statistics.median
    for what, k in (("decode step, batch 1, context 256", 0), ("prefill of 512 tokens", 1)):
        alone = med(r["idle"][k] for r in rounds)
        beside = {m: med(r[m][k] for r in rounds) for m in NEIGHBOUR_MODES[1:]}
        print(f"{what}: alone {1e3 * alone:.1f} ms, beside decodes "
              f"{1e3 * beside['decode']:.1f} ({beside['decode'] / alone:.2f}x), beside "
              f"prefills {1e3 * beside['prefill']:.1f} ({beside['prefill'] / alone:.2f}x)")


if __name__ == "__main__":
    main()
