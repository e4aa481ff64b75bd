"""Model shapes the planner knows: what a model weighs and what its KV cache costs."""

from __future__ import annotations

from dataclasses import dataclass

from shared.engine.config import LLAMA_SHAPES, ModelConfig


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    ffn_size: int
    vocab_size: int
    num_params: int
    kv_size: int  # width of K (= of V) per layer per token: kv_heads * head_dim
    dtype_bytes: int = 2
    kv_dtype_bytes: int = 0  # the KV pool's element (0: dtype_bytes; a CPU pool is float32)

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.kv_size * (self.kv_dtype_bytes or self.dtype_bytes)


def opt(name: str, layers: int, heads: int, hidden: int, ffn: int) -> ModelSpec:
    vocab, positions = 50272, 2048
    params = layers * (4 * hidden * hidden + 2 * hidden * ffn) + (vocab + positions) * hidden
    return ModelSpec(name, layers, hidden, heads, ffn, vocab, params, kv_size=hidden)


def from_config(config: ModelConfig, dtype_bytes: int, kv_dtype_bytes: int = 0) -> ModelSpec:
    return ModelSpec(config.name, config.num_layers, config.hidden_size, config.num_heads,
                     config.intermediate_size, config.vocab_size, config.num_params(),
                     config.kv_size, dtype_bytes, kv_dtype_bytes)


SMOLLM2_135M = ModelConfig(name="smollm2-135m", vocab_size=49152, hidden_size=576,
                           intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                           head_dim=64, rope_theta=100000.0, max_context=8192)

MODELS: dict[str, ModelSpec] = {
    "facebook/opt-13b": opt("facebook/opt-13b", 40, 40, 5120, 20480),
    "facebook/opt-66b": opt("facebook/opt-66b", 64, 72, 9216, 36864),
    "facebook/opt-175b": opt("facebook/opt-175b", 96, 96, 12288, 49152),
    "smollm2-135m": from_config(SMOLLM2_135M, 4),
    **{name: from_config(cfg, 2) for name, cfg in LLAMA_SHAPES.items() if name != "tiny"},
}


class UnknownModelError(ValueError):
    pass


def model_spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise UnknownModelError(f"unknown model {name!r}: known models are {sorted(MODELS)}")
    return MODELS[name]
