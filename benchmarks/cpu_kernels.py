"""The engine's CPU kernels against what they replace, side by side in one run: its float32
matmul over panels against BLAS (`F.linear`, MKL in torch's CPU builds) on the model's own
matrices, and its paged decode attention against the torch gather path (SDPA over the
gathered blocks), at the batch sizes of decode and a prefill's rows.

Weights are cycled through copies worth 64 MB so every call reads them from memory, as a
decode step does; the blocks of each request lie at random places in the pool.

    .venv/bin/python benchmarks/cpu_kernels.py [--model smollm2-135m] [--threads 2]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from shared.engine.attention import DecodeGroup, gather_decode_attention, paged_decode_attention
from shared.engine.config import ModelConfig
from shared.engine.kv_cache import KVCache
from shared.engine.meta import read_config
from shared.engine.panels import PanelMatrix

COLD_BYTES = 64 << 20


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` calls (other tenants only ever add time), after a warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return min(times)


def cycling(fns: list[Callable[[], object]]) -> Callable[[], object]:
    state = {"i": 0}

    def call() -> object:
        state["i"] += 1
        return fns[state["i"] % len(fns)]()
    return call


def matmuls(config: ModelConfig, rows: list[int], repeats: int) -> Table:
    table = Table(title="float32 matmul: the engine's panels vs BLAS (F.linear), weights cold")
    for column in ("matrix (out x in)", "rows of x", "engine ms", "GB/s", "GFLOP/s", "BLAS ms",
                   "BLAS / engine"):
        table.add_column(column, justify="right")
    h, kv = config.hidden_size, config.kv_size
    shapes = {"qkv": (config.q_size + 2 * kv, h), "o": (h, config.q_size),
              "gate/up": (2 * config.intermediate_size, h),
              "down": (h, config.intermediate_size), "lm head": (config.vocab_size, h)}
    for name, (out, inputs) in shapes.items():
        copies = max(1, COLD_BYTES // (out * inputs * 4))
        weights = [torch.randn(out, inputs) for _ in range(copies)]
        packed = [PanelMatrix.pack(w) for w in weights]
        for m in rows:
            x = torch.randn(m, inputs)
            torch.testing.assert_close(packed[0].matmul(x), F.linear(x, weights[0]),
                                       rtol=1e-3, atol=1e-3)
            ours = best_ms(cycling([lambda p=p, x=x: p.matmul(x) for p in packed]), repeats)
            blas = best_ms(cycling([lambda w=w, x=x: F.linear(x, w) for w in weights]), repeats)
            table.add_row(f"{name} {out} x {inputs}", str(m), f"{ours:.3f}",
                          f"{out * inputs * 4 / ours / 1e6:.1f}",
                          f"{2 * m * out * inputs / ours / 1e6:.0f}", f"{blas:.3f}",
                          f"{blas / ours:.2f}x")
    return table


def every_layer(fn: Callable[..., torch.Tensor], q: torch.Tensor, group: DecodeGroup,
                kv: KVCache) -> Callable[[], object]:
    return lambda: [fn(layer, q, group, kv) for layer in range(kv.data.shape[0])]


def attention(config: ModelConfig, batches: list[int], context: int, repeats: int) -> Table:
    table = Table(title=f"decode attention, {config.num_layers} layers at context {context}: "
                        "the paged kernel vs the torch gather path")
    for column in ("batch", "engine ms", "GB/s of K/V", "gather ms", "gather / engine"):
        table.add_column(column, justify="right")
    block = 16
    per_request = -(-context // block)
    blocks = max(batches) * per_request + 1
    kv = KVCache(config, blocks, block, torch.float32, torch.device("cpu"))
    kv.data.normal_()
    for b in batches:
        order = torch.randperm(blocks)[: b * per_request]
        group = DecodeGroup.of(0, order.view(b, per_request), torch.full((b,), context), block)
        q = torch.randn(b, config.num_heads, config.head_dim)
        torch.testing.assert_close(paged_decode_attention(0, q, group, kv),
                                   gather_decode_attention(0, q, group, kv), rtol=1e-4,
                                   atol=1e-4)

        ours = best_ms(every_layer(paged_decode_attention, q, group, kv), repeats)
        gather = best_ms(every_layer(gather_decode_attention, q, group, kv), repeats)
        kv_bytes = config.num_layers * b * context * 2 * config.kv_size * 4
        table.add_row(str(b), f"{ours:.1f}", f"{kv_bytes / ours / 1e6:.1f}", f"{gather:.1f}",
                      f"{gather / ours:.2f}x")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m",
                        help="whose shapes: a built-in name, a GGUF, a directory or a Llama shape")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 512])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = read_config(args.model)
    console = Console()
    console.print(matmuls(config, args.rows, args.repeats))
    console.print(attention(config, args.batches, args.context, max(3, args.repeats // 4)))
    console.print(f"{args.model}, {args.threads} threads, float32")


if __name__ == "__main__":
    main()
