"""Arguments shared by the commands that build an engine."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from pydantic import ValidationError

from shared.engine.config import DTYPE_NAMES, LLAMA_SHAPES, WEIGHT_FORMATS, EngineConfig


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def first_error(e: ValidationError) -> str:
    """Pydantic's first complaint on one line: 'field.path: message'."""
    error = e.errors()[0]
    where = ".".join(str(part) for part in error["loc"])
    return f"{where + ': ' if where else ''}{error['msg']}"


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number above 0: rates, objectives, bandwidths (inf and nan are rejected)."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def existing_dir(text: str) -> Path:
    """A folder that exists now (a run folder to read)."""
    path = Path(text)
    if not path.is_dir():
        why = "not a folder" if path.exists() else "no such folder"
        raise argparse.ArgumentTypeError(f"{why}: {text}")
    return path


def positive_floats(text: str) -> list[float]:
    """Comma-separated positive numbers, e.g. request rates."""
    try:
        return [positive_float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"takes comma-separated positive numbers, got {text!r}") from None


def add_engine_args(parser: argparse.ArgumentParser, tp: bool = True) -> None:
    """The engine's flags; `tp`: with --tp (a command taking several tps defines its own)."""
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default="smollm2-135m",
                       help="built-in model name, path to a .gguf, a Hugging Face model "
                            "directory (Llama, Mistral, Qwen2, Qwen3), or a Llama shape with "
                            f"random weights ({', '.join(LLAMA_SHAPES)}); "
                            "default: %(default)s")
    group.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    group.add_argument("--dtype", default="auto",
                       choices=list(DTYPE_NAMES),
                       help="auto: float32 on CPU; bfloat16 on a GPU that computes it (Ampere "
                            "on), else float16")
    group.add_argument("--weights", default="auto", choices=list(WEIGHT_FORMATS),
                       help="weight format: auto (floats in --dtype), or int8 / int4 blocks "
                            "of 32 (CPU; a GGUF's own Q8_0 / Q4_0 / Q4_1 blocks as stored): "
                            "fewer bytes a decode step reads")
    group.add_argument("--threads", type=non_negative_int, default=0,
                       help="torch threads, shared by the ranks with --tp (0: torch's default; "
                            "with --tp, the cores this process may use)")
    if tp:
        group.add_argument("--tp", type=positive_int, default=1,
                           help="tensor-parallel ranks: processes splitting each layer's heads "
                                "and MLP columns (CPU, gloo); must divide the model's KV heads "
                                "(default: %(default)s)")
        group.add_argument("--pp", type=positive_int, default=1,
                           help="pipeline stages: processes each running a contiguous run of "
                                "layers (of --tp ranks each); the stages run a micro-batch "
                                "each at once (default: %(default)s)")
    group.add_argument("--kv-cache-mb", type=positive_int, default=256,
                       help="memory budget of the paged KV pool in MiB (default: %(default)s)")
    group.add_argument("--block-size", type=positive_int, default=16,
                       help="tokens per KV block (default: %(default)s)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                          weights=args.weights, threads=args.threads,
                          tp=getattr(args, "tp", 1), pp=getattr(args, "pp", 1),
                          kv_cache_bytes=args.kv_cache_mb << 20)
    return config.with_scheduler(block_size=args.block_size)


def without_password(url: str) -> str:
    """The URL as it may be printed: a run's Redis URL carries its password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    return urlunsplit(parts._replace(netloc=f"{host}:{parts.port}" if parts.port else host))
