"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, the chosen tokens'
logprobs and the most likely ones'.

A request's draw for output index i is one uniform number from a generator seeded from
(seed, i) alone, and its row is drawn from on its own, so the same request samples the same
tokens on any instance (of the same build), whatever shares its step, after a KV transfer or a
preemption. A row is sampled by the inverse of its cumulative distribution at that number:
on the CPU in one compiled call for the whole step (kernels/sampling.cpp: temperature, top_k
and top_p together, ~0.05 ms a row of a 49k vocabulary), elsewhere in torch (`_filter`,
`_draw_one`).

Every parameter the API accepts is numerically safe: a temperature below GREEDY_BELOW samples
the argmax, and logits are shifted so that their maximum is 0 before the division, so a small
temperature sends the others towards -inf (probability 0) and never overflows to inf or NaN.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from shared.engine.kernels import cpu_kernels
from shared.engine.request import SamplingParams, TopLogprobs
from shared.engine.structured import Guide, masks

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
    """One row of logits scaled by the temperature, those past top_k and top_p at -inf."""
    # <= 0 with a maximum of exactly 0, so the softmax always has a term of 1 and no NaN
    logits = (logits - logits.max()) / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = _nucleus(logits, params.top_p)
    return logits


def _nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest prefix of the tokens by probability whose mass reaches top_p, and
    always the top token (a top_p below float32's smallest denormal, 5e-324 being valid JSON,
    rounds to 0). Tokens tied with the last one kept are kept too."""
    values = torch.sort(logits, descending=True).values
    probs = values.softmax(-1)
    keep = max(1, int((probs.cumsum(-1) - probs < top_p).sum()))
    return logits.masked_fill(logits < values[keep - 1], float("-inf"))


def _uniform(seed: int, index: int) -> float:
    """The draw in [0, 1) of a request's output index `index`."""
    gen = torch.Generator().manual_seed(draw_seed(seed, index))
    return float(torch.rand(1, dtype=torch.float64, generator=gen))


def _draw_one(logits: torch.Tensor, uniform: float) -> int:
    """A token of one row of filtered logits (maximum 0) at `uniform`, by the inverse of its
    cumulative distribution (the torch path, where the compiled kernels are not: a GPU's).
    A token at -inf has weight 0 and is never the first whose sum passes the draw."""
    cumulative = logits.exp().cumsum(-1)
    point = torch.tensor([uniform * float(cumulative[-1])], dtype=cumulative.dtype,
                         device=logits.device)
    token = int(torch.searchsorted(cumulative, point, right=True))
    if token < logits.shape[-1]:
        return token
    # rounding put the draw at the very end: the last token that has weight
    return int(torch.nonzero(logits > float("-inf")).max())


def _draw(logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
          uniforms: list[float]) -> list[int]:
    """A token of each of `rows` of `logits` under its params, at its uniform draw: on the
    CPU every row in one compiled call (`sample_rows`: the temperature, top_k and top_p
    applied as `_filter` applies them, but ties at a cut broken by the lower token id where
    `_filter` keeps every token tied), else row by row in torch."""
    kernels = cpu_kernels() if logits.device.type == "cpu" and \
        logits.dtype == torch.float32 else None
    if kernels is None:
        return [_draw_one(_filter(logits[r], p), u)
                for r, p, u in zip(rows, params, uniforms, strict=True)]
    vocab = logits.shape[-1]  # a top_k past it cuts nothing (and may not fit an int64)
    drawn = kernels.sample_rows(
        logits.contiguous(), torch.tensor(rows),
        torch.tensor([p.temperature for p in params], dtype=torch.float32),
        torch.tensor([min(p.top_k, vocab) for p in params]),
        torch.tensor([p.top_p for p in params], dtype=torch.float64),
        torch.tensor(uniforms, dtype=torch.float64))
    return drawn.tolist()  # type: ignore[no-any-return]


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           output_index: Sequence[int], scored: torch.Tensor | None = None
           ) -> tuple[list[int], list[float | None]]:
    """One token per row of `logits` ([B, vocab], float32), and its logprob when asked: in
    `scored` where given (the model's distribution, where `logits` has tokens a grammar
    does not allow masked out), else in `logits`."""
    tokens = logits.argmax(-1)
    sampled = [row for row, p in enumerate(params) if not is_greedy(p)]
    if sampled:
        drawn = _draw(logits, sampled, [params[r] for r in sampled],
                      [_uniform(params[r].seed, output_index[r]) for r in sampled])
        tokens[sampled] = torch.tensor(drawn, device=tokens.device)
    chosen = tokens.tolist()
    logprobs: list[float | None] = [None] * len(params)
    wanted = [row for row, p in enumerate(params) if p.logprobs]
    if wanted:
        rows = torch.tensor(wanted, device=logits.device)
        lp = (logits if scored is None else scored)[rows].log_softmax(-1) \
            .gather(1, tokens[rows].unsqueeze(1)).squeeze(1)
        for row, value in zip(wanted, lp.tolist(), strict=True):
            logprobs[row] = value
    return chosen, logprobs


def top_logprobs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> list[TopLogprobs]:
    """Each row's most likely tokens with their logprobs (of the model's distribution, as the
    chosen token's), as many as its params ask for: none for most rows."""
    tops: list[TopLogprobs] = [()] * len(params)
    wanted = [row for row, p in enumerate(params) if p.top_logprobs]
    if wanted:
        k = max(params[row].top_logprobs for row in wanted)
        rows = torch.tensor(wanted, device=logits.device)
        best = likeliest(logits[rows].log_softmax(-1), k)
        for row, top in zip(wanted, best, strict=True):
            tops[row] = top[: params[row].top_logprobs]
    return tops


def likeliest(logprobs: torch.Tensor, k: int) -> list[TopLogprobs]:
    """Each row's k most likely tokens (fewer where the vocabulary is smaller), most likely
    first, with their log-probabilities."""
    best = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return [tuple(zip(ids, values, strict=True))
            for ids, values in zip(best.indices.tolist(), best.values.tolist(), strict=True)]


def adjust(logits: torch.Tensor, params: Sequence[SamplingParams],
           outputs: Sequence[Sequence[int]]) -> torch.Tensor:
    """The logits as sampling sees them: each row that asks lowered by its presence and
    frequency penalties on the tokens its request generated so far (OpenAI's: presence once a
    token appeared, frequency times its count) and raised by its logit_bias. Rows that ask
    nothing are left as they are (and no copy is made when none asks); every row that asks is
    changed in a few tensor operations, not a token at a time."""
    rows = [row for row, p in enumerate(params) if p.adjusts]
    if not rows:
        return logits
    logits = logits.clone()
    vocab, device = logits.shape[-1], logits.device
    penalized = [row for row in rows if params[row].presence_penalty or
                 params[row].frequency_penalty]
    if penalized:  # over the (row, token) pairs generated, not the whole vocabulary
        tokens = torch.cat([torch.tensor(outputs[row], dtype=torch.long) for row in penalized])
        where = torch.repeat_interleave(torch.tensor(penalized),
                                        torch.tensor([len(outputs[r]) for r in penalized]))
        inside = (tokens >= 0) & (tokens < vocab)
        pairs, counts = torch.unique(where[inside] * vocab + tokens[inside],
                                     return_counts=True)
        at, token = pairs // vocab, pairs % vocab
        frequency = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype)
        presence = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype)
        lowered = frequency[at] * counts.to(logits.dtype) + presence[at]
        logits.index_put_((at.to(device), token.to(device)), -lowered.to(device),
                          accumulate=True)
    biased = [row for row in rows if params[row].logit_bias]
    if biased:
        parts = [_bias(params[row].logit_bias, vocab) for row in biased]
        where = torch.cat([torch.full((len(ids),), row, dtype=torch.long)
                           for row, (ids, _) in zip(biased, parts, strict=True)])
        logits.index_put_((where.to(device), torch.cat([ids for ids, _ in parts]).to(device)),
                          torch.cat([v for _, v in parts]).to(device, logits.dtype),
                          accumulate=True)
    return logits


@functools.lru_cache(maxsize=1024)
def _bias(bias: tuple[tuple[int, float], ...], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A logit_bias's token ids (those inside the vocabulary) and values, as tensors: made
    once for a request's params, not every step."""
    inside = [(t, v) for t, v in bias if 0 <= t < vocab]
    return (torch.tensor([t for t, _ in inside], dtype=torch.long),
            torch.tensor([v for _, v in inside], dtype=torch.float32))


def constrain(logits: torch.Tensor, guides: Sequence[Guide | None],
              outputs: Sequence[Sequence[int]]) -> torch.Tensor:
    """`logits` ([rows, vocab]) with each guided row's tokens its grammar does not allow at
    -inf (a copy; the same tensor where no row is guided): the masks (structured.py) applied
    on the CPU in one compiled call (`mask_rows`), elsewhere in torch (`mask_rows`)."""
    rows = [row for row, guide in enumerate(guides) if guide is not None]
    if not rows:
        return logits
    bits = masks([guide for guide in guides if guide is not None], [outputs[r] for r in rows])
    masked = logits.clone()
    kernels = cpu_kernels() if logits.device.type == "cpu" and \
        logits.dtype == torch.float32 else None
    (kernels.mask_rows if kernels is not None else mask_rows)(
        masked, torch.tensor(rows), torch.from_numpy(bits.view(np.int32)))
    return masked


def mask_rows(logits: torch.Tensor, rows: torch.Tensor, bits: torch.Tensor) -> None:
    """kernels/sampling.cpp's `mask_rows` in torch: `rows` of `logits` (in place) at -inf
    where `bits` ([rows, words] int32, token 32 w + j at bit j of word w) does not allow
    them, and past the words' tokens."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    at = rows.to(logits.device)
    logits[at] = logits[at].masked_fill(~allowed.to(logits.device), float("-inf"))

