"""The CPU kernels' tuning knobs tried on the host at hand, in interleaved rounds: each variant
is the kernels' sources with a few constants changed (VARIANTS below; a name ending in
`_avx2` is that variant built for AVX2 + FMA, `-march=x86-64-v3`), built under a name of its
own, and timed on what a step runs: the model's float32 matmuls in turn (every layer's
matrices, then the LM head) at the given rows of x, with MKL's F.linear and the int4 panels
beside them, and decode attention over a scattered pool (every layer, at the batch and
context given).

One call of each, in the same order, makes a round; the table gives each call's median over
the rounds and its spread. Made for lent hosts whose speed moves by half within a minute (a
Xeon whose same call took 1.06 s and then 0.70 s): one variant run after another there
measures the host, not the variant.

    .venv/bin/python benchmarks/kernel_variants.py [--variants base kc256 base_avx2]
        [--rows 32 512] [--batch 32] [--rounds 7] [--threads 2] [--jobs 4] [--build-only]
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from distserve.bench.engine import _ms, rounds
from shared.engine.config import EngineConfig
from shared.engine.kernels import (
    SOURCES,
    build_lock,
    build_name,
    compile_kernels,
    cpu_flags,
    source_text,
)
from shared.engine.kv_cache import KVCache
from shared.engine.meta import read_config
from shared.engine.model_runner import load_model
from shared.engine.panels import PanelMatrix
from shared.engine.quant import QuantizedPanels

sys.path.insert(0, str(Path(__file__).parent))
from kernel_ab import attend, chain, matmul

MODEL = "smollm2-135m-shape"  # SmolLM2-135M's matrices, random weights (no checkpoint needed)

# name -> (text in the sources, its replacement) pairs; each text occurs exactly once
VARIANTS: dict[str, list[tuple[str, str]]] = {
    "base": [],
    # float matmul: a panel's chunk of K held in L2 while a task's rows pass
    "kc128": [("K_CHUNK = 512;", "K_CHUNK = 128;")],
    "kc256": [("K_CHUNK = 512;", "K_CHUNK = 256;")],
    "kc1024": [("K_CHUNK = 512;", "K_CHUNK = 1024;")],
    # float matmul: the AVX-512 register tile, rows x vectors of columns
    "c2r12": [("constexpr int C = W == 16 ? 3", "constexpr int C = W == 16 ? 2"),
              ("constexpr int R = W == 16 ? 8", "constexpr int R = W == 16 ? 12")],
    "c4r6": [("constexpr int C = W == 16 ? 3", "constexpr int C = W == 16 ? 4"),
             ("constexpr int R = W == 16 ? 8", "constexpr int R = W == 16 ? 6"),
             ("constexpr int R2 = W == 16 ? 4", "constexpr int R2 = W == 16 ? 2")],
    # float matmul: rows of x a task
    "mblock4": [("M_BLOCK = 8 * R;", "M_BLOCK = 4 * R;")],
    "mblock16": [("M_BLOCK = 8 * R;", "M_BLOCK = 16 * R;")],
    # decode attention: the next block's K/V prefetched into L1, or not at all
    "att_l1": [("__builtin_prefetch(next + ahead + b, 0, 2);",
                "__builtin_prefetch(next + ahead + b, 0, 3);")],
    "att_nopf": [("__builtin_prefetch(next + ahead + b, 0, 2);", "(void)b;")],
}


# variants of the AVX-512 register tile: an AVX2 build (or a CPU without AVX-512) is the base
AVX512_ONLY = {"c2r12", "c4r6"}


def variant_texts(name: str) -> tuple[list[str], str]:
    """The sources as variant `name` builds them, and its -march."""
    base, avx2 = name.removesuffix("_avx2"), name.endswith("_avx2")
    if base not in VARIANTS:
        raise ValueError(f"no variant {base!r} (variants: {', '.join(VARIANTS)})")
    if avx2 and base in AVX512_ONLY:
        raise ValueError(f"{base} changes the AVX-512 tile only: its AVX2 build is the base")
    texts = [source_text(source) for source in SOURCES]
    for old, new in VARIANTS[base]:
        found = sum(text.count(old) for text in texts)
        if found != 1:
            raise ValueError(f"variant {name}: {old!r} occurs {found} times in the sources")
        texts = [text.replace(old, new) for text in texts]
    return texts, "x86-64-v3" if avx2 else "native"


def build(name: str) -> ModuleType:
    """Variant `name`, built (or loaded from torch's cache) under a name of its own that
    names the CPU's flags too, as the engine's own builds are (a build for one CPU is never
    loaded on another), and under the same lock (a build killed half-way is not waited on)."""
    texts, march = variant_texts(name)
    cache = build_name(platform.machine(), march, cpu_flags()) + f"_variant_{name}"
    with build_lock(cache):
        return compile_kernels(cache, texts, march)


def prebuild(name: str) -> None:
    """Build variant `name` into torch's extension cache (a worker process's job)."""
    build(name)


def mkl_chain(dense: list[torch.Tensor], xs: dict[int, torch.Tensor]) -> None:
    for w in dense:
        F.linear(xs[w.shape[1]], w)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=["base", "base_avx2"],
                        help=f"of {', '.join(VARIANTS)}; _avx2 after a name: its AVX2 build")
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 512],
                        help="rows of x of the matmuls")
    parser.add_argument("--batch", type=int, default=32, help="decode attention's batch")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=4, help="variants built at once")
    parser.add_argument("--build-only", action="store_true",
                        help="build the variants into torch's cache and stop (on all cores, "
                             "before a run held to a few)")
    args = parser.parse_args()
    args.variants = list(dict.fromkeys(args.variants))
    if "base" not in args.variants:
        parser.error("--variants: include base (the ratios are to it)")
    if args.rounds < 1 or args.jobs < 1:
        parser.error("--rounds and --jobs: at least 1")
    for name in args.variants:
        try:
            variant_texts(name)  # known, and every substitution applies, before any build
        except ValueError as e:
            parser.error(str(e))
    console = Console()
    console.print(f"building {len(args.variants)} variants ...")
    with ProcessPoolExecutor(min(args.jobs, len(args.variants))) as pool:
        list(pool.map(prebuild, args.variants))  # into torch's cache; loaded below
    if args.build_only:
        return
    builds = {name: build(name) for name in args.variants}
    for name in AVX512_ONLY & set(builds):
        if builds[name].panel_width() == builds["base"].panel_width():
            parser.error(f"{name} is the base on this CPU (no AVX-512 tile to change)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = read_config(MODEL)
    int4 = load_model(EngineConfig(model=MODEL, weights="int4"))[0]
    quantized: list[QuantizedPanels] = [getattr(layer, name) for layer in int4.layers
                                        for name in ("qkv", "o", "gate_up", "down")]
    assert isinstance(int4.lm_head, QuantizedPanels)
    quantized.append(int4.lm_head)
    dense = [torch.randn(*m.shape) for m in quantized]
    by_width: dict[int, list[PanelMatrix]] = {}  # builds of one width share their panels
    for module in builds.values():
        width = module.panel_width()
        by_width.setdefault(width, [PanelMatrix.pack(w, width=width) for w in dense])
    panels = {name: by_width[module.panel_width()] for name, module in builds.items()}
    base = builds["base"]

    calls: dict[str, Callable[[], object]] = {}
    for rows in args.rows:
        xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in dense}
        x = xs[dense[0].shape[1]]
        for name, module in builds.items():
            first = panels[name][0]
            torch.testing.assert_close(matmul(module, x, first), F.linear(x, dense[0]),
                                       rtol=1e-3, atol=1e-3)
            calls[f"matmuls, {rows} rows: {name}"] = functools.partial(
                chain, module, panels[name], xs)
        calls[f"matmuls, {rows} rows: MKL"] = functools.partial(mkl_chain, dense, xs)
        calls[f"matmuls, {rows} rows: int4 panels"] = functools.partial(
            chain, base, quantized, xs)
    block = 16
    per = -(-args.context // block)
    kv = KVCache(config, args.batch * per + 1, block, torch.float32, torch.device("cpu"))
    kv.data.normal_()
    q = torch.randn(args.batch, config.num_heads, config.head_dim)
    tables = torch.randperm(args.batch * per + 1)[: args.batch * per].view(args.batch, per)
    lens = torch.full((args.batch,), args.context)
    for name, module in builds.items():
        calls[f"attention, batch {args.batch}: {name}"] = functools.partial(
            attend, module, q, kv, tables, lens)

    times = dict(zip(calls, rounds([functools.partial(_ms, call) for call in calls.values()],
                                   args.rounds), strict=True))
    table = Table(title=f"{MODEL}, {args.threads} threads, {args.rounds} interleaved rounds: ms "
                        f"(attention: {config.num_layers} layers at context {args.context})")
    # float32 panels unless named: MKL's F.linear on the same floats, base's int4 panels
    for column in ("call", "median ms", "min - max", "base / this"):
        table.add_column(column, justify="right")
    for label, ms in times.items():
        what = label.rsplit(": ", 1)[0]
        reference = times.get(f"{what}: base", ms)
        median = statistics.median(ms)
        table.add_row(label, f"{median:.2f}", f"{min(ms):.1f} - {max(ms):.1f}",
                      f"{statistics.median(reference) / median:.2f}x")
    console.print(table)


if __name__ == "__main__":
    main()
