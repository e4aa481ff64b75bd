"""How far a model's predictions move with its weight format or dtype, measured, not assumed:
each sequence runs through both models in one prefill (teacher forcing: every position sees
the reference text, so one early difference does not derail the rest), and we count the
positions where the two agree on the most likely next token, and each model's perplexity on
the text. A disaggregated pair is measured as it serves: one model prefills the prompt (its KV
and the first token), the other runs the rest over that KV."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.engine.attention import AttentionMetadata, PrefillSegment
from shared.engine.kv_cache import KVCache
from shared.engine.model import LlamaModel
from shared.engine.model_runner import kv_dtype


@torch.inference_mode()
def next_token_logits(model: LlamaModel, ids: Sequence[int], prefilled_by: LlamaModel | None = None,
                      prompt: int = 0) -> torch.Tensor:
    """[len(ids), vocab] float32 logits of the token after each position, over a KV pool of
    its own (in the engine's KV dtype): in one prefill, or, with `prefilled_by`, its prefill
    of the first `prompt` positions and then `model`'s of the rest over their KV."""
    if prefilled_by is not None and not 0 < prompt < len(ids):
        raise ValueError(f"a prompt of {prompt} of {len(ids)} tokens for the other model to "
                         "prefill: it needs one at least, and leaves one at least")
    n, block = len(ids), 16
    device = model.device
    kv = KVCache(model.config, -(-n // block), block, kv_dtype(device, model.dtype), device)
    table = torch.arange(kv.num_blocks, device=device)
    parts = [(model, 0, n)] if prefilled_by is None else [(prefilled_by, 0, prompt),
                                                          (model, prompt, n)]
    logits = []
    for runs, start, end in parts:
        positions = torch.arange(start, end, device=device)
        meta = AttentionMetadata(slots=positions, decode=None,
                                 prefills=[PrefillSegment(0, end - start, start, table)])
        hidden = runs.forward(torch.tensor(list(ids[start:end]), device=device), positions,
                              meta, kv)
        logits.append(runs.logits(hidden).float().cpu())
    return torch.cat(logits)


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
            scored_from: Sequence[int], prefilled_by: LlamaModel | None = None) -> Agreement:
    """`model` against `reference` on `sequences`, scoring the next tokens of positions from
    `scored_from[i]` on (a prompt's own tokens are context, not text to predict). With
    `prefilled_by`, that model prefills each prompt and `model` continues its KV."""
    agree = total = 0
    nll = reference_nll = 0.0
    for ids, start in zip(sequences, scored_from, strict=True):
        targets = torch.tensor(list(ids[start:]))
        ours = next_token_logits(model, ids, prefilled_by, start)[start - 1:-1]
        theirs = next_token_logits(reference, ids)[start - 1:-1]
        agree += int((ours.argmax(-1) == theirs.argmax(-1)).sum())
        total += len(targets)
        nll += float(torch.nn.functional.cross_entropy(ours, targets, reduction="sum"))
        reference_nll += float(torch.nn.functional.cross_entropy(theirs, targets,
                                                                 reduction="sum"))
    return Agreement(total, agree / total, math.exp(nll / total), math.exp(reference_nll / total))
