"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, chosen logprobs.

A request's draw for output index i uses a generator seeded from (seed, i) alone, so the same
request samples the same tokens on any instance, after a KV transfer or a preemption.

Every parameter the API accepts is numerically safe: a temperature below GREEDY_BELOW samples
the argmax, and logits are shifted so that their maximum is 0 before the division, so a small
temperature sends the others towards -inf (probability 0) and never overflows to inf or NaN.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shared.engine.request import SamplingParams

_MIX = 0x9E3779B97F4A7C15
_MASK = (1 << 63) - 1
# Below this a temperature is greedy (vLLM's threshold too): dividing by it would scale the
# logits past what float32 tells apart, and 1e-40 is a float32 denormal.
GREEDY_BELOW = 1e-5


def draw_seed(seed: int, index: int) -> int:
    return (seed * _MIX + index + 1) & _MASK


def is_greedy(params: SamplingParams) -> bool:
    return params.greedy or params.temperature < GREEDY_BELOW


def _filter(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    # <= 0 with a maximum of exactly 0, so the softmax always has a term of 1 and no NaN
    logits = (logits - logits.max()) / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p, and always the top token: a
        # top_p below float32's smallest denormal (5e-324 is valid JSON) rounds to 0
        drop = cumulative - sorted_logits.softmax(-1) >= params.top_p
        drop[0] = False
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           output_index: Sequence[int]) -> tuple[list[int], list[float | None]]:
    """One token per row of `logits` ([B, vocab], float32), and its logprob when asked."""
    tokens = logits.argmax(-1)
    for row, p in enumerate(params):
        if not is_greedy(p):
            probs = _filter(logits[row], p).softmax(-1)
            gen = torch.Generator(device=logits.device).manual_seed(
                draw_seed(p.seed, output_index[row]))
            tokens[row] = torch.multinomial(probs, 1, generator=gen)[0]
    chosen = tokens.tolist()
    logprobs: list[float | None] = [None] * len(params)
    wanted = [row for row, p in enumerate(params) if p.logprobs]
    if wanted:
        rows = torch.tensor(wanted, device=logits.device)
        lp = logits[rows].log_softmax(-1).gather(1, tokens[rows].unsqueeze(1)).squeeze(1)
        for row, value in zip(wanted, lp.tolist(), strict=True):
            logprobs[row] = value
    return chosen, logprobs
