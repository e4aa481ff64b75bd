"""Drawing a step's tokens: this tree's sampler against a git revision's, interleaved in one
process, on the real model's next-token logits (SmolLM2-135M over HumanEval prompts and their
solutions) and on random ones (flatter: top_p's nucleus runs past the first candidates).

    .venv/bin/python benchmarks/sampling.py --base 38c8966 [--threads 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
from rich.console import Console
from rich.table import Table

from distserve.bench.engine import _ms, side_by_side
from distserve.bench.workload import humaneval_prompts
from shared.engine.config import EngineConfig
from shared.engine.model_runner import load_model
from shared.engine.quality import next_token_logits
from shared.engine.request import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"temperature 1 (the API's default)": SamplingParams(temperature=1.0),
            "temperature 0.7, top_p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
            "temperature 1, top_k 50": SamplingParams(temperature=1.0, top_k=50),
            "greedy": SamplingParams(temperature=0.0)}


def sampler_at(revision: str) -> ModuleType:
    """shared/engine/sampler.py as it is at `revision`, imported under a name of its own."""
    text = subprocess.run(["git", "show", f"{revision}:shared/engine/sampler.py"], cwd=ROOT,
                          check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "sampler_base.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("sampler_base", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["sampler_base"] = module
    spec.loader.exec_module(module)
    return module


def timed(module: ModuleType, logits: torch.Tensor, params: list[SamplingParams],
          index: list[int]) -> Callable[[], float]:
    return lambda: _ms(lambda: module.sample(logits, params, index))


def model_logits(rows: int) -> torch.Tensor:
    model, tokenizer = load_model(EngineConfig())
    assert tokenizer is not None
    out = []
    for prompt, solution in humaneval_prompts():
        out.append(next_token_logits(model, tokenizer.encode(prompt + solution)))
        if sum(len(o) for o in out) >= rows:
            break
    logits = torch.cat(out)
    return logits[torch.linspace(0, len(logits) - 1, rows).long()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the git revision to compare with")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from shared.engine import sampler

    base = sampler_at(args.base)
    real = model_logits(max(args.batches))
    table = Table(title=f"ms to draw a step's tokens, {args.threads} threads")
    for column in ("logits", "batch", "sampling", args.base, "this tree", "speed-up"):
        table.add_column(column, justify="right")
    for source in ("model", "random"):
        for batch in args.batches:
            logits = real[:batch] if source == "model" else \
                torch.randn(batch, real.shape[1], generator=torch.Generator().manual_seed(0)) * 3
            index = list(range(batch))
            for name, params in SETTINGS.items():
                every = [params] * batch
                before, now = side_by_side([timed(base, logits, every, index),
                                            timed(sampler, logits, every, index)], args.repeats)
                table.add_row(source, str(batch), name, f"{before:.2f}", f"{now:.2f}",
                              f"{before / now:.1f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
