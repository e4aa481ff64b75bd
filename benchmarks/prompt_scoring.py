"""What scoring a prompt costs its prefill (echo with logprobs, how evaluation harnesses read
a text's likelihood): one prompt prefilled alone, with its tokens scored, and scored with
their top 5, side by side, interleaved, median of `--repeats`.

    .venv/bin/python benchmarks/prompt_scoring.py [--lengths 512 2048] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from rich.console import Console
from rich.table import Table

from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.request import SamplingParams
from shared.host import cpu_description

KINDS = {"prefill": SamplingParams(max_tokens=1),
         "scored": SamplingParams(max_tokens=1, logprobs=True, prompt_logprobs=True),
         "scored, top 5": SamplingParams(max_tokens=1, logprobs=True, prompt_logprobs=True,
                                         top_logprobs=5)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    engine = Engine(EngineConfig(model=args.model))
    table = Table(title=f"prompt scoring, {args.model} ({cpu_description()})")
    for column in ("prompt tokens", *(f"{k} (ms)" for k in KINDS), "scored / prefill",
                   "top 5 / prefill"):
        table.add_column(column, justify="right")
    for length in args.lengths:
        prompt = [(t * 7919) % 40000 + 100 for t in range(length)]
        times: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for _ in range(args.repeats):
            for kind, params in KINDS.items():
                start = time.perf_counter()
                engine.generate([prompt], params)
                times[kind].append(time.perf_counter() - start)
        ms = {kind: 1000 * statistics.median(t) for kind, t in times.items()}
        table.add_row(str(length), *(f"{ms[k]:,.1f}" for k in KINDS),
                      f"{ms['scored'] / ms['prefill']:.2f}x",
                      f"{ms['scored, top 5'] / ms['prefill']:.2f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
