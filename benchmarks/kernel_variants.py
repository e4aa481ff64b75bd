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
        [--rows 32 512] [--batch 32] [--rounds 7] [--threads 2] [--jobs 8] [--build-only]
"""

from __future__ import annotations

import argparse
import functools
import statistics
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from types import ModuleType

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from distserve.commands.bench_engine import _ms, rounds
from shared.engine.config import EngineConfig
from shared.engine.kernels import SOURCES, compile_kernels, source_text
from shared.engine.kv_cache import KVCache
from shared.engine.loader import read_config
from shared.engine.model_runner import load_model
from shared.engine.quant import NO_MINS, QuantizedPanels

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


def variant_texts(name: str) -> tuple[list[str], str]:
    """The sources as variant `name` builds them, and its -march."""
    base, avx2 = name.removesuffix("_avx2"), name.endswith("_avx2")
    texts = [source_text(source) for source in SOURCES]
    for old, new in VARIANTS[base]:
        found = sum(text.count(old) for text in texts)
        if found != 1:
            raise ValueError(f"variant {name}: {old!r} occurs {found} times in the sources")
        texts = [text.replace(old, new) for text in texts]
    return texts, "x86-64-v3" if avx2 else "native"


def build(name: str) -> ModuleType:
    texts, march = variant_texts(name)
    return compile_kernels(f"kernel_variant_{name}", texts, march)


def prebuild(name: str) -> None:
    """Build variant `name` into torch's extension cache (a worker process's job)."""
    build(name)


def packed(w: torch.Tensor, width: int) -> torch.Tensor:
    """w (out, in) as a build's panels [ceil(out / width), in, width] (PanelMatrix's layout at
    that build's width, which a tile variant may change)."""
    out, inputs = w.shape
    panels = torch.zeros(-(-out // width), inputs, width)
    for p in range(panels.shape[0]):
        part = w[p * width:(p + 1) * width]
        panels[p, :, :part.shape[0]] = part.t()
    return panels


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
    if "base" not in args.variants:
        parser.error("--variants: include base (the ratios are to it)")
    for name in args.variants:
        variant_texts(name)  # every substitution applies, before any build
    console = Console()
    with console.status(f"building {len(args.variants)} variants"):
        with ProcessPoolExecutor(min(args.jobs, len(args.variants))) as pool:
            list(pool.map(prebuild, args.variants))  # into torch's cache; loaded below
        if args.build_only:
            return
        builds = {name: build(name) for name in args.variants}
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = read_config(MODEL)
    int4 = load_model(EngineConfig(model=MODEL, weights="int4"))[0]
    quantized: list[QuantizedPanels] = [getattr(layer, name) for layer in int4.layers
                                        for name in ("qkv", "o", "gate_up", "down")]
    quantized.append(int4.lm_head)
    dense = [torch.randn(*m.shape) for m in quantized]
    panels = {name: [(packed(w, module.panel_width()), w.shape[0]) for w in dense]
              for name, module in builds.items()}
    base = builds["base"]

    calls: dict[str, Callable[[], object]] = {}
    for rows in args.rows:
        xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in dense}
        x = xs[dense[0].shape[1]]
        for name, module in builds.items():
            first, n = panels[name][0]
            torch.testing.assert_close(module.float_matmul(x, first, n), F.linear(x, dense[0]),
                                       rtol=1e-3, atol=1e-3)
            calls[f"matmuls, {rows} rows: {name}"] = (
                lambda m=module, ps=panels[name], xs=xs:
                [m.float_matmul(xs[p.shape[1]], p, n) for p, n in ps])
        calls[f"matmuls, {rows} rows: MKL"] = (
            lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in dense])
        calls[f"matmuls, {rows} rows: int4 panels"] = (
            lambda xs=xs: [base.quantized_matmul(xs[q.shape[1]], q.weights, q.scales,
                                                 NO_MINS if q.mins is None else q.mins, q.bits,
                                                 q.out_features) for q in quantized])
    block = 16
    per = -(-args.context // block)
    kv = KVCache(config, args.batch * per + 1, block, torch.float32, torch.device("cpu"))
    kv.data.normal_()
    q = torch.randn(args.batch, config.num_heads, config.head_dim)
    tables = torch.randperm(args.batch * per + 1)[: args.batch * per].view(args.batch, per)
    lens = torch.full((args.batch,), args.context)
    for name, module in builds.items():
        calls[f"attention, batch {args.batch}: {name}"] = (
            lambda m=module: [m.paged_decode_attention(q, kv.data[layer, 0], kv.data[layer, 1],
                                                       tables, lens, config.head_dim ** -0.5)
                              for layer in range(config.num_layers)])

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
