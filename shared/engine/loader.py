"""Loading a model by its name: a Hugging Face model directory, a GGUF file (a path or a
built-in name), or a Llama shape with random weights (no tokenizer). Its shape and tokenizer
alone, without torch: shared/engine/meta.py."""

from __future__ import annotations

from pathlib import Path

import torch

from shared.engine import hf_checkpoint
from shared.engine.config import LLAMA_SHAPES, weight_bits
from shared.engine.gguf_weights import load_gguf
from shared.engine.meta import read_meta
from shared.engine.model import WHOLE, LlamaModel
from shared.engine.parallel.layout import RankPlace
from shared.engine.tokenizer import TextTokenizer

LoadedModel = tuple[LlamaModel, TextTokenizer | None]


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
