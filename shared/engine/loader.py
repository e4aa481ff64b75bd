"""What a model name means, and reading it: a Hugging Face model directory, a GGUF file (a path
or a built-in name), or a Llama shape with random weights (no tokenizer)."""

from __future__ import annotations

from pathlib import Path

import torch

from shared.engine import hf_checkpoint
from shared.engine.config import LLAMA_SHAPES, ModelConfig, served_name, weight_bits
from shared.engine.gguf_loader import load_gguf, read_gguf_meta, read_gguf_tokenizer
from shared.engine.model import WHOLE, LlamaModel
from shared.engine.parallel.layout import RankPlace
from shared.engine.tokenizer import TextTokenizer

LoadedModel = tuple[LlamaModel, TextTokenizer | None]


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


def load(model: str, seed: int, device: torch.device, dtype: torch.dtype,
         weights: str = "auto", place: RankPlace = WHOLE) -> LoadedModel:
    """`weights`: "auto" (floats in `dtype`), "int8" or "int4" (quantized matrices; a GGUF's
    blocks of that kind read as they are). `place`: the part of it one rank of a parallel
    instance holds."""
    bits = weight_bits(weights)
    if model in LLAMA_SHAPES:
        return LlamaModel.random(LLAMA_SHAPES[model], seed, device, dtype, bits, place), None
    if hf_checkpoint.is_model_dir(model):
        config, tokenizer = read_meta(model)  # before the weights: fail fast
        config, tensors = hf_checkpoint.read_weights(Path(model), config)
        return LlamaModel(config, tensors, device, dtype, bits, place), tokenizer
    gguf = load_gguf(model, keep_blocks=bits)
    return LlamaModel.from_numpy(gguf.config, gguf.weights, device, dtype, bits, place), \
        TextTokenizer.from_gguf(gguf.tokenizer)
