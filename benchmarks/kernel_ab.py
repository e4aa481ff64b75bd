"""The engine's CPU kernels as a git revision built them against the working tree, side by
side in one process: decode attention, and the model's float32 and int4 matmuls in turn (a
decode step's or a prefill's, at the given rows of x). Both builds are compiled from their
sources (the kernels' `.cpp` files and vec.h) under names of their own, and their calls
interleave, so drift in a shared machine's speed hits both alike.

A request's K/V blocks lie in the pool in order (a fresh pool, as `distserve bench engine`
fills it) or at random places (a pool that has served a while: freed blocks go back to the
free list and are handed out again in any order). Every layer is read once a step, as a
decode step reads them (30 layers of SmolLM2 at context 512 and batch 32: 755 MB, from
memory).

The matrices are the model's own (every layer's, then the LM head), read in a step's order,
so each is cold when its turn comes.

    .venv/bin/python benchmarks/kernel_ab.py --base HEAD~1 [--threads 2] [--batches 1 8 32]
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

from distserve.bench.engine import _ms, side_by_side
from shared.engine.config import EngineConfig
from shared.engine.kernels import (
    FUNCTIONS,
    SOURCES,
    compile_kernels,
    source_text,
    without_own_header,
)
from shared.engine.kv_cache import KVCache
from shared.engine.meta import read_config
from shared.engine.model_runner import load_model
from shared.engine.quant import NO_MINS, QuantizedPanels

ROOT = Path(__file__).resolve().parents[1]


def sources_at(revision: str | None) -> list[str]:
    """The kernels' sources as a build gets them (`source_text`) at `revision`, or as they
    are in the working tree (None)."""
    if revision is None:
        return [source_text(source) for source in SOURCES]
    shown = [subprocess.run(
        ["git", "show", f"{revision}:{source.relative_to(ROOT).as_posix()}"], cwd=ROOT,
        capture_output=True, text=True) for source in SOURCES]
    return [without_own_header(s.stdout) for s in shown if s.returncode == 0]  # those it has


def build(label: str, texts: list[str]) -> ModuleType:
    digest = hashlib.sha256("\n".join(texts).encode()).hexdigest()[:12]
    defined = [f for f in FUNCTIONS if any(re.search(rf"\b{f}\(", t) for t in texts)]
    return compile_kernels(f"kernel_ab_{label}_{digest}", texts, "native", defined)


def interleaved(calls: dict[str, Callable[[], object]], repeats: int) -> list[float]:
    """Median ms of each call, their runs interleaved after a warm-up round."""
    return side_by_side([functools.partial(_ms, call) for call in calls.values()], repeats)


def matmul(module: ModuleType, x: torch.Tensor, matrix: Any) -> torch.Tensor:
    if isinstance(matrix, QuantizedPanels):
        mins = NO_MINS if matrix.mins is None else matrix.mins
        out = module.quantized_matmul(x, matrix.weights, matrix.scales, mins, matrix.bits,
                                      matrix.out_features)
    else:
        out = module.float_matmul(x, matrix.panels, matrix.out_features)
    assert isinstance(out, torch.Tensor)
    return out


def chain(module: ModuleType, matrices: list[Any], xs: dict[int, torch.Tensor]) -> None:
    for matrix in matrices:
        matmul(module, xs[matrix.shape[1]], matrix)


def attend(module: ModuleType, q: torch.Tensor, kv: KVCache, tables: torch.Tensor,
           lens: torch.Tensor) -> list[torch.Tensor]:
    scale = q.shape[-1] ** -0.5
    return [module.paged_decode_attention(q, kv.data[layer, 0], kv.data[layer, 1], tables, lens,
                                          scale) for layer in range(kv.data.shape[0])]


def matmul_chains(builds: dict[str, ModuleType], model: str, rows: list[int], repeats: int,
                  table: Table) -> None:
    for weights in ("auto", "int4"):
        llama = load_model(EngineConfig(model=model, weights=weights))[0]
        matrices = [getattr(layer, name) for layer in llama.layers
                    for name in ("qkv", "o", "gate_up", "down")] + [llama.lm_head]
        for m in rows:
            xs = {matrix.shape[1]: torch.randn(m, matrix.shape[1]) for matrix in matrices}
            base, tree = interleaved({label: functools.partial(chain, module, matrices, xs)
                                      for label, module in builds.items()},
                                     repeats if m < 512 else 3)
            table.add_row(f"matmuls, {'float32' if weights == 'auto' else weights}",
                          f"{m} rows", f"{base:.2f}", f"{tree:.2f}", f"{base / tree:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD", help="the git revision to compare against")
    parser.add_argument("--model", default="smollm2-135m", help="whose attention shape")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 512],
                        help="rows of x of the matmuls (0: none)")
    parser.add_argument("--repeats", type=int, default=9, help="interleaved rounds (median)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    console = Console()
    with console.status("building both revisions' kernels"):
        builds = {args.base: build("base", sources_at(args.base)),
                  "working tree": build("tree", sources_at(None))}
    config = read_config(args.model)
    table = Table(title=f"{args.model}, {args.threads} threads: ms a step (decode attention: "
                        f"{config.num_layers} layers at context {args.context}, K/V GB/s)")
    for column in ("kernel", "batch or rows", f"{args.base}", "working tree", "speed-up"):
        table.add_column(column, justify="right")
    block, per = args.block_size, -(-args.context // args.block_size)
    for batch in track(args.batches, description="batches", console=console, transient=True):
        blocks = batch * per + 1
        kv = KVCache(config, blocks, block, torch.float32, torch.device("cpu"))
        kv.data.normal_()
        q = torch.randn(batch, config.num_heads, config.head_dim)
        lens = torch.full((batch,), args.context)
        pools = {"in order": torch.arange(batch * per).view(batch, per),
                 "scattered": torch.randperm(blocks)[: batch * per].view(batch, per)}
        kv_bytes = config.num_layers * batch * args.context * 2 * config.kv_size * 4
        for pool, tables in pools.items():
            first, second = (attend(module, q, kv, tables, lens)[-1]
                             for module in builds.values())
            torch.testing.assert_close(first, second, rtol=1e-4, atol=1e-4)
            base, tree = interleaved({label: functools.partial(attend, module, q, kv, tables, lens)
                                      for label, module in builds.items()}, args.repeats)
            table.add_row(f"attention, pool {pool}", str(batch),
                          f"{base:.2f} ({kv_bytes / base / 1e6:.1f})",
                          f"{tree:.2f} ({kv_bytes / tree / 1e6:.1f})", f"{base / tree:.2f}x")
    if any(args.rows):
        with console.status("the model's matmuls"):
            matmul_chains(builds, args.model, [m for m in args.rows if m], args.repeats, table)
    console.print(table)


if __name__ == "__main__":
    main()
