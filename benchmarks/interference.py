"""How much one engine slows another on this host: one process's decode step and 512-token
prefill, beside a second engine process that is idle, decoding or prefilling, 1 thread
each, in interleaved rounds so drift hits every side alike.

    .venv/bin/python benchmarks/interference.py [--rounds 5] [--steps 40] [--prefills 2]

The measurement is `distserve profile`'s (services/planner/profiling.py: the contention
factors a CPU profile carries, the median of 3 rounds' ratios); this prints its step times
and each round's ratios side by side, and the median ratios as the profile would take them.
On a GPU, a prefill instance and a decode instance on separate GPUs do not share compute or
memory bandwidth. Two cores of one CPU socket share the last-level cache and the
memory bus, so "separate devices" here still interfere; this measures by how much.
"""

from __future__ import annotations

import argparse
import statistics

from services.planner.profiling import NEIGHBOUR_MODES, contention_rounds, round_ratios
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40, help="decode steps a phase")
    parser.add_argument("--prefills", type=int, default=2, help="prefills a phase")
    parser.add_argument("--neighbour-batch", type=int, default=1,
                        help="requests the neighbour decodes at once (the profile's: 1)")
    args = parser.parse_args()
    config = EngineConfig(threads=1)
    engine = Engine(config)
    try:
        rounds = contention_rounds(engine, config, args.rounds, args.steps, args.prefills,
                                   neighbour_batch=args.neighbour_batch)
    finally:
        engine.close()
    med = statistics.median
    ratios = {(m, k): round_ratios(rounds, m, k) for m in NEIGHBOUR_MODES[1:] for k in (0, 1)}
    for i in range(len(rounds)):
        print(f"round {i + 1}: decode beside a neighbour decoding "
              f"{ratios['decode', 0][i]:.2f}x, prefilling {ratios['prefill', 0][i]:.2f}x; "
              f"prefill {ratios['decode', 1][i]:.2f}x, {ratios['prefill', 1][i]:.2f}x")
    for what, k in (("decode step, batch 1, context 256", 0), ("prefill of 512 tokens", 1)):
        alone = med(r["idle"][k] for r in rounds)
        beside = {m: med(r[m][k] for r in rounds) for m in NEIGHBOUR_MODES[1:]}
        print(f"{what}: alone {1e3 * alone:.1f} ms, beside decodes "
              f"{1e3 * beside['decode']:.1f} ({beside['decode'] / alone:.2f}x), beside "
              f"prefills {1e3 * beside['prefill']:.1f} ({beside['prefill'] / alone:.2f}x)")
        print(f"  the median of the rounds' ratios (the profile's factors): beside decodes "
              f"{med(ratios['decode', k]):.2f}x, beside prefills {med(ratios['prefill', k]):.2f}x")


if __name__ == "__main__":
    main()
