"""A decode step's layers in one compiled call against the same layers one operation at a
time, in one engine, the two interleaved step by step (the only fair A/B on a host whose
memory bandwidth moves within the hour). With `--base REV`, the fused layers as REV's
kernels build them against the working tree's, swapped step by step in the same engine:

    .venv/bin/python benchmarks/fused_decode.py [--weights auto int4] [--batches 1 8 32]
    .venv/bin/python benchmarks/fused_decode.py --base HEAD~1
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from rich.console import Console
from rich.table import Table

from distserve.bench.engine import EngineDecode, side_by_side
from shared.engine import panels, quant
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.kernels import cpu_kernels

sys.path.insert(0, str(Path(__file__).parent))
from kernel_ab import build, sources_at


def toggled(engine: Engine, decode: EngineDecode, fused: bool) -> Callable[[], float]:
    def step() -> float:
        engine.runner.model.fused_decode = fused
        return decode()
    return step


def built(engine: Engine, decode: EngineDecode, kernels: ModuleType) -> Callable[[], float]:
    """Steps on `kernels`: the layers' and the LM head's (float or quantized panels)."""
    def step() -> float:
        engine.runner.model.ops = kernels
        panels.cpu_kernels = quant.cpu_kernels = lambda: kernels
        return decode()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--weights", nargs="+", default=["auto", "int4"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40, help="timed steps each way")
    parser.add_argument("--base", help="a git revision: its fused layers against the tree's")
    args = parser.parse_args()
    base = None if args.base is None else build("base", sources_at(args.base))
    if base is not None and not hasattr(base, "decode_layers"):
        parser.error(f"{args.base} has no fused layers")
    table = Table(title=f"decode step (ms), context {args.context}, {args.threads} threads")
    first = "one op at a time" if base is None else f"fused at {args.base}"
    for column in ("weights", "batch", first, "fused layers", "speed-up"):
        table.add_column(column, justify="right")
    for weights in args.weights:
        config = EngineConfig(model=args.model, weights=weights, threads=args.threads,
                              kv_cache_bytes=2 << 30).with_scheduler(
            max_batch_tokens=max(args.batches) * args.context, max_running=max(args.batches))
        engine = Engine(config)
        if engine.runner.model.fused_layers is None:
            parser.error(f"{weights}: this model's layers do not fuse here")
        for batch in args.batches:
            decode = EngineDecode(engine, batch, args.context, 2 * args.steps + 8)
            ways = ([toggled(engine, decode, False), toggled(engine, decode, True)]
                    if base is None else
                    [built(engine, decode, base), built(engine, decode, cpu_kernels())])
            apart, fused = side_by_side(ways, args.steps)
            decode.close()
            table.add_row(weights, str(batch), f"{apart:.2f}", f"{fused:.2f}",
                          f"{apart / fused:.2f}x")
        engine.close()
    Console().print(table)


if __name__ == "__main__":
    main()
