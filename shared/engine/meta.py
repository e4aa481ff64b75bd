"""What a model name means, without its weights or torch: its shape and its tokenizer, from a
Hugging Face model directory or a GGUF file (a path or a built-in name); of a Llama shape,
its config alone (it has no tokenizer). The gateway, the planner and the workload builders
read only these."""

from __future__ import annotations

from pathlib import Path

from shared.engine import hf_checkpoint
from shared.engine.config import LLAMA_SHAPES, ModelConfig, served_name
from shared.engine.gguf_loader import read_gguf_meta, read_gguf_tokenizer
from shared.engine.tokenizer import TextTokenizer


def read_tokenizer(model: str) -> TextTokenizer:
    """Only the tokenizer (cheap: the gateway and the workload builders need no weights)."""
    if hf_checkpoint.is_model_dir(model):
        return hf_checkpoint.read_tokenizer(Path(model))
    return TextTokenizer.from_gguf(read_gguf_tokenizer(model))


def read_meta(model: str) -> tuple[ModelConfig, TextTokenizer]:
    """Config and tokenizer without reading any weight."""
    if hf_checkpoint.is_model_dir(model):
        directory = Path(model)
        return hf_checkpoint.read_config(directory, served_name(model)), \
            hf_checkpoint.read_tokenizer(directory)
    config, data = read_gguf_meta(model)
    return config, TextTokenizer.from_gguf(data)


def read_config(model: str) -> ModelConfig:
    """The model's shape, reading no weight."""
    if model in LLAMA_SHAPES:
        return LLAMA_SHAPES[model]
    return read_meta(model)[0]
