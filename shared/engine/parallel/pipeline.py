"""One step through an instance's stages, the same code on every rank: a stage takes the
previous stage's hidden states (the first embeds the tokens), runs its layers and hands its
output on; the last stage's output returns to rank 0, which samples. Stages run one after
another within a step."""

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
    """This rank's part of a step; on rank 0, the final hidden states of the whole model."""
    place = model.place
    hidden = None
    if place.source is not None:
        hidden = _empty(model, ids)
        receive(hidden, place.source)
    out = model.forward(ids, positions, meta, kv, hidden)
    if place.target is not None:
        send(out, place.target)
    if place.rank == 0 and place.pp > 1:
        out = _empty(model, ids)
        receive(out, (place.pp - 1) * place.tp)
    return out


def _empty(model: LlamaModel, ids: torch.Tensor) -> torch.Tensor:
    return torch.empty(ids.numel(), model.config.hidden_size, device=model.device,
                       dtype=model.dtype)
