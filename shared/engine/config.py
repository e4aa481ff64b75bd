"""Frozen configuration objects for the model and the engine."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def served_name(model: str) -> str:
    """The name clients ask for: a model directory's own name, otherwise the model as named."""
    return Path(model).resolve().name if Path(model).is_dir() else model


# --weights: "auto" keeps floats in the engine's dtype; int8 and int4 are blocks of 32 weights
# with a scale (and a minimum) each, for the CPU's quantized matmul (shared.engine.quant)
WEIGHT_FORMATS: dict[str, int | None] = {"auto": None, "int8": 8, "int4": 4}
QUANT_BLOCK = 32  # weights a quantization block has, with its scale (and minimum)


# --dtype: what an engine computes in; "auto" is float32 on a CPU, bfloat16 (or float16) on a GPU
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")


def kv_element_bytes(dtype: str, on_gpu: bool) -> int:
    """Bytes of an element of the KV pool of an instance computing in `dtype`, without torch
    (model_runner.kv_dtype): float32 on a CPU whatever it computes in; on a GPU its compute
    dtype ("auto": a 16-bit one)."""
    return 2 if on_gpu and dtype != "float32" else 4


def check_dtype(name: str) -> None:
    """ValueError for a dtype name the engine does not know."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}: choose one of {list(DTYPE_NAMES)}")


def weight_bits(name: str) -> int | None:
    """The bits a weight of format `name` takes (None: floats); ValueError for an unknown one."""
    if name not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {name!r}: choose one of {list(WEIGHT_FORMATS)}")
    return WEIGHT_FORMATS[name]


@dataclass(frozen=True)
class RopeScaling:
    """How positions stretch past the trained context: `linear` divides every frequency by
    `factor`; `llama3` (Llama 3.1+) leaves high frequencies alone, divides low ones by
    `factor` and blends the band between."""

    kind: str  # "linear" or "llama3"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_context: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder. The families differ in small, named ways: Qwen2 adds
    a bias to the Q/K/V projections, Qwen3 RMS-normalises each Q and K head before RoPE, Llama
    3.1 scales RoPE's frequencies."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_context: int = 4096
    tie_embeddings: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: RopeScaling | None = None
    architecture: str = "llama"  # for logs and errors

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, "GQA needs heads divisible by kv heads"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, i = self.hidden_size, self.intermediate_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        per_layer += (self.q_size + 2 * self.kv_size) * self.qkv_bias  # Qwen2
        per_layer += 2 * self.head_dim * self.qk_norm  # Qwen3
        embed = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.kv_size * dtype_bytes


# Shapes for profiling the engine at realistic sizes with random weights.
LLAMA_SHAPES: dict[str, ModelConfig] = {
    "llama-2-7b": ModelConfig(
        name="llama-2-7b", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
        num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128, max_context=4096,
        tie_embeddings=False,
    ),
    "llama-2-13b": ModelConfig(
        name="llama-2-13b", vocab_size=32000, hidden_size=5120, intermediate_size=13824,
        num_layers=40, num_heads=40, num_kv_heads=40, head_dim=128, max_context=4096,
        tie_embeddings=False,
    ),
    "llama-3-8b": ModelConfig(
        name="llama-3-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
        max_context=8192, tie_embeddings=False,
    ),
    # Llama-3.2-1B's shape (its long-context RoPE scaling aside): 8 KV heads for tp 2, 4 and
    # 8 at a size a many-core CPU runs in seconds.
    "llama-3.2-1b": ModelConfig(
        name="llama-3.2-1b", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0,
        max_context=8192, tie_embeddings=True,
    ),
    # SmolLM2-135M's shape with random weights, for its figures where its GGUF cannot go
    "smollm2-135m-shape": ModelConfig(
        name="smollm2-135m-shape", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
        max_context=8192, tie_embeddings=True,
    ),
    # Qwen2.5-0.5B's shape (2 KV heads: tp 2 splits it), for tensor-parallel figures on a CPU.
    "qwen2.5-0.5b": ModelConfig(
        name="qwen2.5-0.5b", vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, rope_theta=1000000.0,
        rms_norm_eps=1e-6, max_context=32768, qkv_bias=True, architecture="qwen2",
    ),
    # A tiny shape for fast tests of the engine mechanics.
    "tiny": ModelConfig(
        name="tiny", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, max_context=512,
    ),
}


class Role(enum.Enum):
    """What an engine does with a request."""

    PREFILL = "prefill"  # prefill, sample the first token, keep the KV until released
    DECODE = "decode"  # continue requests whose KV was imported
    COLOCATED = "colocated"  # both phases in one loop (vLLM-style baseline)


@dataclass(frozen=True)
class SchedulerConfig:
    role: Role = Role.COLOCATED
    block_size: int = 16
    # Token budget of one step: L_m for prefill batches, the chunk budget when chunked.
    max_batch_tokens: int = 2048
    max_running: int = 128  # decode batch size cap
    chunked_prefill: bool = False
    # Free blocks kept back when admitting a new prefill, so running decodes can grow.
    watermark_blocks: int = 1
    # A prompt's leading blocks found in the pool (computed for an earlier request with the
    # same start) are reused, not computed again (block_manager.py). The services turn it
    # on; off here, so that an engine measured (profiles, benchmarks) computes every prompt
    prefix_caching: bool = False

    def __post_init__(self) -> None:
        assert self.block_size > 0 and self.max_batch_tokens > 0 and self.max_running > 0


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m"  # a GGUF name or path, a HF directory or a LLAMA_SHAPES key
    device: str = "auto"  # "cpu", "cuda", "cuda:1" or "auto"
    dtype: str = "auto"  # "float32", "bfloat16", "float16", "auto" (CPU fp32, GPU bf16 or fp16)
    weights: str = "auto"  # "auto" (floats in dtype), "int8" or "int4" (CPU, float32 compute)
    kv_cache_bytes: int = 256 * 1024 * 1024  # memory budget of the paged KV pool
    threads: int = 0  # torch intra-op threads (shared by the ranks); 0: torch's default
    tp: int = 1  # tensor-parallel ranks a pipeline stage (processes; one device each on GPUs)
    pp: int = 1  # pipeline stages (each of tp ranks)
    seed: int = 0  # seed for random (dummy) weights
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"tp and pp must be at least 1, not {self.tp} and {self.pp}")
        if self.threads < 0:
            raise ValueError(f"threads must be 0 (torch's default) or more, not {self.threads}")

    @property
    def ranks(self) -> int:
        return self.tp * self.pp

    def with_scheduler(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, scheduler=dataclasses.replace(self.scheduler, **changes))
