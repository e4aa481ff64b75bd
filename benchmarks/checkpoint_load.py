"""Load time and peak memory of a Hugging Face checkpoint against its size on disk: a random
checkpoint of a Llama shape is written once (safetensors, sharded, in --disk-dtype), then a
fresh process loads it with the engine (in --dtype) and reports its time and the growth of
its peak resident memory, next to the bytes the loaded model holds. Loading reads one tensor
at a time from the memory-mapped shards, so the peak should stay near one copy of the model
(in the engine's dtype), not the checkpoint plus the model.

    .venv/bin/python benchmarks/checkpoint_load.py [--shape llama-3.2-1b] [--dir /tmp/ckpt]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

SHAPES = {  # config.json of Llama shapes (tied embeddings as the 1B/3B models)
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         tie_word_embeddings=True),
    "small": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                  num_attention_heads=16, num_key_value_heads=4, vocab_size=49152,
                  tie_word_embeddings=False),
}


def write(directory: Path, shape: dict[str, object], dtype: torch.dtype,
          shard_bytes: int = 1 << 30) -> None:
    """A random checkpoint in the layout transformers writes, with SmolLM2's tokenizer (the
    load reads the tokenizer too; its vocabulary need not match for this)."""
    from safetensors.torch import save_file

    from shared.engine.meta import read_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    h, i = int(shape["hidden_size"]), int(shape["intermediate_size"])  # type: ignore[call-overload]
    heads, kv = int(shape["num_attention_heads"]), int(shape["num_key_value_heads"])  # type: ignore[call-overload]
    d, v = h // heads, int(shape["vocab_size"])  # type: ignore[call-overload]
    gen = torch.Generator().manual_seed(0)

    def rand(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=gen) * 0.02).to(dtype)

    tensors = {"model.embed_tokens.weight": rand(v, h), "model.norm.weight": rand(h)}
    if not shape["tie_word_embeddings"]:
        tensors["lm_head.weight"] = rand(v, h)
    for layer in range(int(shape["num_hidden_layers"])):  # type: ignore[call-overload]
        p = f"model.layers.{layer}."
        tensors |= {p + "self_attn.q_proj.weight": rand(heads * d, h),
                    p + "self_attn.k_proj.weight": rand(kv * d, h),
                    p + "self_attn.v_proj.weight": rand(kv * d, h),
                    p + "self_attn.o_proj.weight": rand(h, heads * d),
                    p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
                    p + "mlp.down_proj.weight": rand(h, i),
                    p + "input_layernorm.weight": rand(h),
                    p + "post_attention_layernorm.weight": rand(h)}
    shards: list[dict[str, torch.Tensor]] = [{}]
    for name, tensor in tensors.items():
        if sum(t.nbytes for t in shards[-1].values()) + tensor.nbytes > shard_bytes:
            shards.append({})
        shards[-1][name] = tensor
    weight_map = {}
    for n, shard in enumerate(shards, 1):
        file = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
         "max_position_embeddings": 4096, "rope_theta": 500000.0, **shape}))
    read_tokenizer("smollm2-135m")._tokenizer.save(str(directory / "tokenizer.json"))


def child(directory: str, dtype: str) -> None:
    """In a fresh process: load and print the figures as JSON."""
    from shared.engine.loader import load
    from shared.engine.model_runner import DTYPES

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    started = time.perf_counter()
    model, _ = load(directory, 0, torch.device("cpu"), DTYPES[dtype])
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    held = [model.embed, model.norm, *([] if model.lm_head is model.embed else [model.lm_head])]
    for layer in model.layers:  # tensors, and matrices packed in panels
        held += [t for t in vars(layer).values() if t is not None]
    print(json.dumps({"seconds": seconds, "grew": peak - before,
                      "model": sum(t.nbytes for t in held)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where the checkpoint is (written there if absent)")
    parser.add_argument("--disk-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32",
                        help="the engine's dtype (default: float32, as on CPU)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.dtype)
    directory = args.dir or Path(f"/tmp/checkpoint-{args.shape}-{args.disk_dtype}")
    if not (directory / "config.json").exists():
        print(f"writing a random {args.shape} checkpoint ({args.disk_dtype}) to {directory} ...")
        write(directory, SHAPES[args.shape], getattr(torch, args.disk_dtype))
    disk = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    out = subprocess.run([sys.executable, __file__, "--child", str(directory), "--dtype",
                          args.dtype], capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    gib = 1 << 30
    print(f"{args.shape}: {disk / gib:.2f} GiB on disk ({args.disk_dtype}), loaded as "
          f"{args.dtype} in {r['seconds']:.1f} s ({disk / gib / r['seconds']:.2f} GiB/s read); "
          f"the model holds {r['model'] / gib:.2f} GiB, the process's peak memory grew "
          f"{r['grew'] / gib:.2f} GiB ({r['grew'] / r['model']:.2f}x the model, "
          f"{r['grew'] / (disk + r['model']):.2f}x checkpoint + model)")


if __name__ == "__main__":
    main()
