"""How long a process takes to start serving: reading the model's GGUF header (gguf-py's
reader against ours, side by side), building an engine, and starting a stack to healthy.

    .venv/bin/python benchmarks/startup.py [--model smollm2-135m] [--repeats 3] [--stacks 3]

Every start of a gateway, a worker or a rank reads the header (the tokenizer is in it), and
every worker builds an engine, so these times are what a restart after a crash costs before
the instance serves again. Figures are medians, seconds. The first stack start of a process
also imports torch in it; it is shown apart.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from gguf import GGUFReader

from services.launcher import Stack, StackConfig
from services.supervisor import free_port
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.gguf_file import GgufFile
from shared.engine.gguf_loader import resolve_gguf_path


def median_s(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def stack_starts(model: str, count: int) -> list[float]:
    """Seconds from start to healthy of a 1 prefill + 1 decode stack, `count` times."""
    times = []
    for _ in range(count):
        with tempfile.TemporaryDirectory() as run_dir:
            stack = Stack(StackConfig(port=free_port(), run_dir=Path(run_dir), model=model,
                                      prefill=1, decode=1))
            start = time.perf_counter()
            try:
                stack.start(timeout=600)
                times.append(time.perf_counter() - start)
            finally:
                stack.stop()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="a built-in name or a .gguf path")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each in-process timing")
    parser.add_argument("--stacks", type=int, default=3, help="stack starts (0: none)")
    args = parser.parse_args()
    path = resolve_gguf_path(args.model)
    theirs = median_s(lambda: GGUFReader(path), args.repeats)
    ours = median_s(lambda: GgufFile(path), args.repeats)
    print(f"GGUF header of {path.name}: gguf-py {theirs:.3f} s, ours {ours:.3f} s "
          f"({theirs / ours:.1f}x)")
    Engine(EngineConfig(model="tiny"))  # the kernels loaded once, as in any worker
    for weights in ("auto", "int4"):
        built = median_s(lambda w=weights: Engine(EngineConfig(model=args.model, weights=w)),
                         args.repeats)
        print(f"engine ({weights} weights) built in {built:.2f} s")
    if args.stacks:
        first, *rest = stack_starts(args.model, args.stacks)
        print(f"stack (gateway, 1 prefill, 1 decode) start to healthy: first {first:.1f} s"
              + (f", then median {statistics.median(rest):.1f} s" if rest else ""))


if __name__ == "__main__":
    main()
