"""How far a model's predictions move with its weight format, measured, not assumed: each
sequence runs through both models in one prefill (teacher forcing: every position sees the
reference text, so one early difference does not derail the rest), and we count the positions
where the two agree on the most likely next token, and each model's perplexity on the text."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.engine.attention import AttentionMetadata, PrefillSegment
from shared.engine.kv_cache import KVCache
from shared.engine.model import LlamaModel


@torch.inference_mode()
def next_token_logits(model: LlamaModel, ids: Sequence[int]) -> torch.Tensor:
    """[len(ids), vocab] float32 logits of the token after each position, in one prefill
    over a KV pool of its own."""
    n, block = len(ids), 16
    kv = KVCache(model.config, -(-n // block), block, model.dtype, model.device)
    positions = torch.arange(n, device=model.device)
    meta = AttentionMetadata(slots=positions, decode=None, prefills=[
        PrefillSegment(0, n, 0, torch.empty(0, dtype=torch.long, device=model.device))])
    hidden = model.forward(torch.tensor(list(ids), device=model.device), positions, meta, kv)
    return model.logits(hidden).float().cpu()


@dataclass(frozen=True)
class Agreement:
    positions: int  # next tokens compared
    top1: float  # share of them where both models rank the same token first
    perplexity: float  # the model's on the scored tokens
    reference_perplexity: float

    @property
    def perplexity_ratio(self) -> float:
        return self.perplexity / self.reference_perplexity


def compare(model: LlamaModel, reference: LlamaModel, sequences: Sequence[Sequence[int]],
            scored_from: Sequence[int]) -> Agreement:
    """`model` against `reference` on `sequences`, scoring the next tokens of positions from
    `scored_from[i]` on (a prompt's own tokens are context, not text to predict)."""
    agree = total = 0
    nll = reference_nll = 0.0
    for ids, start in zip(sequences, scored_from, strict=True):
        targets = torch.tensor(list(ids[start:]))
        ours, theirs = (next_token_logits(m, ids)[start - 1:-1] for m in (model, reference))
        agree += int((ours.argmax(-1) == theirs.argmax(-1)).sum())
        total += len(targets)
        nll += float(torch.nn.functional.cross_entropy(ours, targets, reduction="sum"))
        reference_nll += float(torch.nn.functional.cross_entropy(theirs, targets,
                                                                 reduction="sum"))
    return Agreement(total, agree / total, math.exp(nll / total), math.exp(reference_nll / total))
