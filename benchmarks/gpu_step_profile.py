"""Where a decode step's time goes on a GPU, and decode attention's variants side by side:
the engine decodes a batch at a context; each variant (SDPA with every backend allowed, the
engine's, two matmuls over a head-major gather) attends for `--steps` steps in turn, rounds
interleaved (medians of ms a step); then torch's profiler splits the engine's step into the
GPU's kernel time and the rest (Python, launches, host-device copies), with the top operators
by host time.

    python benchmarks/gpu_step_profile.py --model llama-3-8b --batches 1 32 --context 512
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

from distserve.bench.engine import EngineDecode, side_by_side
from shared.engine.attention import DecodeGroup, gather_decode_attention, pick_decode_attention
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.kv_cache import KVCache


def default_sdpa_attention(layer: int, q: torch.Tensor, group: DecodeGroup,
                           kv: KVCache) -> torch.Tensor:
    """The gather and SDPA with every backend allowed (cuDNN's, on Hopper, with a mask)."""
    keys, values = kv.gather(layer, group.block_tables)
    b, heads, dim = q.shape
    qg = q.view(b, keys.shape[2], heads // keys.shape[2], dim)
    return F.scaled_dot_product_attention(qg, keys.transpose(1, 2), values.transpose(1, 2),
                                          attn_mask=group.mask).reshape(b, -1)


def head_major_matmul_attention(layer: int, q: torch.Tensor, group: DecodeGroup,
                                 kv: KVCache) -> torch.Tensor:
    """Two batched matmuls and a softmax in float32 over the blocks gathered head-major
    ([H_kv, B, L, D]: each head and request's keys one matrix at one stride from the next)."""
    b, heads, dim = q.shape
    pool = kv.data[layer].permute(0, 3, 1, 2, 4)  # [2, H_kv, blocks, block_size, D]
    kv_heads = pool.shape[1]
    keys, values = pool[:, :, group.block_tables].flatten(3, 4).unbind(0)  # [H_kv, B, L, D]
    qg = q.view(b, kv_heads, heads // kv_heads, dim).transpose(0, 1)  # [H_kv, B, G, D]
    scores = torch.matmul(qg, keys.transpose(2, 3)).float() * dim ** -0.5  # [H_kv, B, G, L]
    mask = group.mask.view(1, b, 1, -1)
    probs = scores.masked_fill_(~mask, float("-inf")).softmax(-1).to(values.dtype)
    return torch.matmul(probs, values).transpose(0, 1).reshape(b, -1)


VARIANTS: dict[str, Callable[..., torch.Tensor]] = {
    "sdpa-default": default_sdpa_attention, "engine": gather_decode_attention,
    "head-major-matmul": head_major_matmul_attention}


def runnable(engine: Engine) -> dict[str, Callable[..., torch.Tensor]]:
    """The variants that run on this device (each tried once on a small group)."""
    kv, config = engine.runner.kv, engine.model_config
    device = engine.runner.device
    group = DecodeGroup.of(0, torch.tensor([[1, 2]], device=device),
                           torch.tensor([20], device=device), kv.block_size)
    q = torch.randn(1, config.num_heads, config.head_dim, device=device,
                    dtype=engine.runner.dtype)
    usable = {}
    for name, attend in VARIANTS.items():
        try:
            attend(0, q, group, kv)
            usable[name] = attend
        except RuntimeError as e:
            print(f"{name} does not run here: {str(e).splitlines()[0]}")
    return usable


def compare(engine: Engine, variants: dict[str, Callable[..., torch.Tensor]],
            picked: Callable[..., torch.Tensor], batch: int, args: argparse.Namespace) -> None:
    """The variants side by side at `batch`, then the engine's own step profiled."""
    model = engine.runner.model
    total = (args.rounds + 1) * len(variants) * args.steps + 2 * args.steps + 8
    decoding = EngineDecode(engine, batch, args.context, total)

    def steps_of(attend: Callable[..., torch.Tensor]) -> float:
        """ms a step over `--steps` steps, attending with `attend`."""
        model.decode_attention = attend
        return sum(decoding() for _ in range(args.steps)) / args.steps

    medians = dict(zip(variants, side_by_side(
        [functools.partial(steps_of, attend) for attend in variants.values()], args.rounds),
        strict=True))
    base = medians["sdpa-default"]
    print(f"batch {batch}, context {args.context}+: ms a step, median of {args.rounds} "
          "rounds: " + ", ".join(f"{n} {ms:.2f} ({base / ms:.2f}x sdpa-default)"
                                 for n, ms in medians.items()))
    wall = steps_of(picked)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            with record_function("engine.step"):
                decoding()
    decoding.close()
    events = prof.key_averages()
    steps = next(e.count for e in events if e.key == "engine.step")
    kernels = sum(e.self_device_time_total for e in events  # kernels only: an operator
                  if e.device_type == torch.autograd.DeviceType.CUDA  # holds its kernels'
                  and not e.is_user_annotation) / 1e3 / steps  # time too, a range spans it
    launches = sum(e.count for e in events if "LaunchKernel" in e.key) / steps
    print(f"  {picked.__name__}: {wall:.2f} ms a step unprofiled; GPU kernels {kernels:.2f} ms "
          f"a step ({kernels / wall:.0%} of it); {launches:.0f} kernel launches a step "
          f"({steps} steps profiled)")
    print(events.table(sort_by="cpu_time_total", row_limit=args.top, max_name_column_width=44))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10, help="steps a variant a round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    engine = Engine(EngineConfig(model=args.model, device=args.device,
                                 kv_cache_bytes=16 << 30).with_scheduler(max_running=256))
    picked = pick_decode_attention(engine.runner.device)
    print(f"{args.model} on {engine.runner.device} ({engine.runner.dtype}); the engine's "
          f"decode attention: {picked.__name__}")
    variants = runnable(engine)
    for batch in args.batches:
        compare(engine, variants, picked, batch, args)


if __name__ == "__main__":
    main()
