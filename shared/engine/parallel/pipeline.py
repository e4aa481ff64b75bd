"""One step through an instance's stages, the same code on every rank: a stage takes the
previous stage's hidden states (the first embeds the tokens), runs its layers and hands its
output on, to the next stage or, from the last, to rank 0, which samples. Each stage runs a
step as soon as its input arrives: rank 0 starts the next micro-batch while later stages
still run the one before (a pipeline)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from shared.engine.attention import AttentionMetadata
from shared.engine.kv_cache import KVCache
from shared.engine.model import LlamaModel

Send = Callable[[torch.Tensor, int], None]  # (tensor, to rank)
Receive = Callable[[torch.Tensor, int], None]  # (into tensor, from rank)


def run_stage(model: LlamaModel, kv: KVCache, ids: torch.Tensor, positions: torch.Tensor,
              meta: AttentionMetadata, send: Send, receive: Receive) -> torch.Tensor:
    """This rank's part of a step: its stage's output (handed on where a stage follows)."""
    place = model.place
    hidden = None
    if place.source is not None:
        hidden = hidden_states(model, ids.numel())
        receive(hidden, place.source)
    out = model.forward(ids, positions, meta, kv, hidden)
    if place.target is not None:
        send(out, place.target)
    return out


def last_stage(model: LlamaModel) -> int:
    """The rank whose output is the whole model's hidden states (rank 0 receives them)."""
    return (model.place.pp - 1) * model.place.tp


def hidden_states(model: LlamaModel, tokens: int) -> torch.Tensor:
    """Room for a stage's output over `tokens` tokens."""
    return torch.empty(tokens, model.config.hidden_size, device=model.device,
                       dtype=model.dtype)
