"""The HF transformers model on the same weights (the GGUF, the model directory, or a Llama
shape's random weights): the reference the engine is checked and benchmarked against.
transformers is a test/benchmark extra, imported only here."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

from shared.engine.config import LLAMA_SHAPES, ModelConfig
from shared.engine.gguf_loader import resolve_gguf_path
from shared.engine.hf_checkpoint import engine_name, is_model_dir
from shared.engine.model import RandomWeights


def hf_installed() -> bool:
    """Whether transformers is installed (the test extras; `make install` leaves it out)."""
    return importlib.util.find_spec("transformers") is not None


def load_hf_reference(model: str, dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu", seed: int = 0) -> Any:
    """The HF causal LM (eager PyTorch, HF's default attention) on the model's weights, on
    `device`; a Llama shape's are the random weights the engine draws from `seed` there."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as e:  # pragma: no cover - depends on the install
        raise RuntimeError("the HF reference needs the test extras: pip install -e '.[test]'") \
            from e
    device = torch.device(device)
    hf: Any
    if model in LLAMA_SHAPES:
        hf = _random_shape(LLAMA_SHAPES[model], seed, device, dtype)
    elif is_model_dir(model):
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    else:
        path = resolve_gguf_path(model)
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  dtype=dtype)
    hf.to(device).requires_grad_(False)
    return hf


def _random_shape(config: ModelConfig, seed: int, device: torch.device,
                  dtype: torch.dtype) -> Any:
    """transformers' model of the shape, holding the engine's random weights (drawn on the
    same device in the same dtype, so the same numbers)."""
    import transformers

    if config.qk_norm or config.rope_scaling is not None:
        raise ValueError(f"no HF reference for the random shape {config.name}")
    kind: Any = transformers.Qwen2Config if config.qkv_bias else transformers.LlamaConfig
    hf_config = kind(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim, max_position_embeddings=config.max_context,
        rms_norm_eps=config.rms_norm_eps, tie_word_embeddings=config.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta})
    auto: Any = transformers.AutoModelForCausalLM
    with device:
        hf = auto.from_config(hf_config, dtype=dtype)
    weights = RandomWeights(config, seed, device, dtype)
    copied = set()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            ours = engine_name(name)
            if ours is None or ours not in weights:
                raise ValueError(f"HF's {name} has no counterpart among the engine's weights")
            param.copy_(weights[ours])
            copied.add(ours)
    if copied != set(weights):
        raise ValueError(f"HF's {config.name} lacks the engine's {sorted(set(weights) - copied)}")
    return hf
