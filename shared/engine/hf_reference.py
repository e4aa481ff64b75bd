"""The HF transformers model on the same weights (the GGUF, or the model directory): the
reference the engine is checked and benchmarked against. transformers is a test/benchmark
extra, imported only here."""

from __future__ import annotations

import os
from typing import Any

import torch

from shared.engine.gguf_loader import resolve_gguf_path
from shared.engine.hf_checkpoint import is_model_dir


def load_hf_reference(model: str, dtype: torch.dtype = torch.float32) -> Any:
    """The HF causal LM (eager PyTorch, HF's default attention) on the model's weights."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as e:  # pragma: no cover - depends on the install
        raise RuntimeError("the HF reference needs the test extras: pip install -e '.[test]'") \
            from e
    if is_model_dir(model):
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    else:
        path = resolve_gguf_path(model)
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  dtype=dtype)
    hf.requires_grad_(False)
    return hf
