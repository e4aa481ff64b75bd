"""A prefill instance in bfloat16 against one in float32: prefill time, the two engines
interleaved round by round (the host's moments fall on both), and what the pairs a
disaggregated stack can run cost in accuracy, teacher-forced on HumanEval's prompts with their
canonical solutions: the prompt prefilled in bfloat16 (its KV kept in float32), the solution
continued by a float32 or int4 decode model, against float32 throughout; and bfloat16
throughout, what a colocated worker in bfloat16 computes.

    .venv/bin/python benchmarks/prefill_dtype.py [--threads 1] [--lengths 128 512]
        [--rounds 7] [--quality 164]

bfloat16 can pay where the CPU multiplies it natively (AVX512_BF16's dot products, AMX): it
did on a Zen 5 (1.3x), not on a Xeon with AVX512_BF16 and no AMX (0.6x); on an AVX2-only CPU
torch emulates it and float32 is the faster prefill.
"""

from __future__ import annotations

import argparse

import torch
from rich.console import Console
from rich.table import Table

from distserve.bench.engine import EnginePrefill, side_by_side
from distserve.bench.workload import humaneval_prompts
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.model_runner import load_model
from shared.engine.quality import compare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a stack "
                        "worker's default: 1)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds a length")
    parser.add_argument("--quality", type=int, default=164, metavar="N",
                        help="HumanEval problems scored (0: none)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    console = Console()
    models = {dtype: load_model(EngineConfig(model=args.model, dtype=dtype))
              for dtype in ("float32", "bfloat16")}
    engines = {dtype: Engine(EngineConfig(model=args.model, dtype=dtype).with_scheduler(
        max_batch_tokens=max(args.lengths)), models[dtype]) for dtype in models}
    table = Table(title=f"prefill (ms, medians of {args.rounds} interleaved rounds), "
                        f"{args.threads} thread(s)")
    for column in ("prompt tokens", "float32", "bfloat16", "float32 / bfloat16"):
        table.add_column(column, justify="right")
    for length in args.lengths:
        runs = [EnginePrefill(engines[dtype], length) for dtype in ("float32", "bfloat16")]
        fp32, bf16 = side_by_side(list(runs), args.rounds)
        table.add_row(str(length), f"{fp32:.1f}", f"{bf16:.1f}", f"{fp32 / bf16:.2f}x")
    console.print(table)
    if not args.quality:
        return
    fp32, bf16 = models["float32"][0], models["bfloat16"][0]
    int4 = load_model(EngineConfig(model=args.model, weights="int4"))[0]
    tokenizer = models["float32"][1]
    assert tokenizer is not None, "--quality needs a model with a tokenizer"
    sequences, starts = [], []
    for prompt, solution in humaneval_prompts()[:args.quality]:
        context = tokenizer.encode(prompt, add_special_tokens=True)
        sequences.append(context + tokenizer.encode(solution))
        starts.append(len(context))
    quality = Table(title=f"against float32 throughout, teacher-forced on {len(sequences)} "
                          "HumanEval solutions")
    for column in ("prefill", "decode", "top-1 agreement", "perplexity", "float32's"):
        quality.add_column(column, justify="right")
    for prefill, decode, model, prefilled_by in (
            ("bfloat16", "float32", fp32, bf16), ("bfloat16", "int4", int4, bf16),
            ("bfloat16", "bfloat16", bf16, None)):
        with console.status(f"scoring {prefill} prefill, {decode} decode"):
            agreement = compare(model, fp32, sequences, starts, prefilled_by=prefilled_by)
        quality.add_row(prefill, decode, f"{agreement.top1:.2%}",
                        f"{agreement.perplexity:.3f}", f"{agreement.reference_perplexity:.3f}")
    console.print(quality)


if __name__ == "__main__":
    main()
