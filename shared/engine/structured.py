"""Structured output: an answer held to a JSON schema (OpenAI's `response_format`), token by
token, with llguidance's matcher.

The gateway turns a response format into a grammar (`json_grammar`, checked by
`grammar_error` before any instance sees it) and sends it with the request's sampling; an
engine gives each request that has one a `Guide` when it takes the request in, and masks the
tokens the grammar does not allow at every token it samples (`constrain`). A guide feeds
itself the request's output tokens as they come, whoever sampled them: the first token on a
prefill instance, the rest on a decode instance, the tokens a failed-over request streamed
before elsewhere. So the grammar travels as text and no matcher state crosses a process.

Once the grammar is complete only an end-of-sequence token is allowed, so the answer stops
there ("stop"), or at max_tokens before ("length", the JSON unfinished, as OpenAI's).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from llguidance import LLMatcher, LLTokenizer

from shared.engine.kernels import cpu_kernels
from shared.engine.tokenizer import TextTokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

log = logging.getLogger(__name__)

# the JSON text's layout: Python's json.dumps' (", " and ": ", no newlines); JSON allowing
# any whitespace lets a small model spend its tokens on blank lines
LAYOUT: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ",
                              "key_separator": ": "}


# a grammar travels in the request's messages (NATS takes 1 MB a message): OpenAI's own
# bounds on a schema (100 properties, 15,000 characters of names and values) fit in far less
MAX_GRAMMAR_BYTES = 64 << 10


def json_grammar(schema: dict[str, Any] | None, strict: bool = False) -> str:
    """The grammar of JSON text valid against `schema` (None: any JSON object, OpenAI's
    json_object). Not `strict`: keywords llguidance does not implement are ignored (the
    answer is still JSON); `strict`: they are errors. ValueError says what is wrong (an
    unknown type, a bad pattern, a number JSON cannot hold, too large a schema)."""
    try:
        grammar = LLMatcher.grammar_from_json_schema(
            {"type": "object"} if schema is None else schema,
            defaults=LAYOUT | {"lenient": not strict})
        error = LLMatcher.validate_grammar(grammar)
    except (ValueError, TypeError) as e:
        raise ValueError(str(e)) from None
    if error:
        raise ValueError(error)
    if len(grammar) > MAX_GRAMMAR_BYTES:
        raise ValueError(f"the schema is too large ({len(grammar)} bytes as a grammar; at "
                         f"most {MAX_GRAMMAR_BYTES})")
    return grammar


class Guide:
    """One request's grammar: its matcher, fed the request's output tokens up to those it
    has seen."""

    def __init__(self, matcher: LLMatcher, ends: Sequence[int], vocab: int) -> None:
        self.matcher = matcher
        self.fed = 0
        # the end-of-sequence ids alone: what follows a token outside the grammar
        self.ends = np.zeros((vocab + 31) // 32, dtype=np.uint32)
        for end in ends:
            self.ends[end // 32] |= np.uint32(1 << (end % 32))

    def allowed(self, output_ids: Sequence[int]) -> np.ndarray:
        """The tokens that may come after `output_ids`: a bit each, token 32 w + j at bit j
        of word w (uint32). A token the grammar refused (none drawn within it is) puts the
        matcher in error: from there only an end of sequence is allowed."""
        new = list(output_ids[self.fed:])
        self.fed = len(output_ids)
        if new and not self.matcher.is_error() and not self.matcher.consume_tokens(new):
            log.warning("a token outside the grammar: %s", self.matcher.get_error())
        if self.matcher.is_error():
            return self.ends
        words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint32)
        return words if words.any() else self.ends


class Guides:
    """An engine's guides: the tokenizer llguidance reads (built once, on the first request
    with a grammar: ~0.3 s for a 49k vocabulary) and a guide for each such request."""

    def __init__(self, tokenizer: TextTokenizer, vocab: int) -> None:
        self.text_tokenizer, self.vocab = tokenizer, vocab
        self.ends = sorted(tokenizer.eos_ids)

    @functools.cached_property
    def tokenizer(self) -> LLTokenizer:
        return LLTokenizer(self.text_tokenizer.to_json(), n_vocab=self.vocab,
                           eos_token=self.ends)

    def guide(self, grammar: str) -> Guide:
        """A new request's guide; ValueError if the grammar does not compile."""
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the grammar does not compile: {matcher.get_error()}")
        return Guide(matcher, self.ends, self.vocab)


def constrain(logits: torch.Tensor, guides: Sequence[Guide | None],
              outputs: Sequence[Sequence[int]]) -> torch.Tensor:
    """`logits` ([rows, vocab]) with each guided row's tokens the grammar does not allow at
    -inf (a copy; the same tensor where no row is guided): on the CPU in one compiled call
    (`mask_rows`), elsewhere in torch (`mask_rows`)."""
    rows = [row for row, guide in enumerate(guides) if guide is not None]
    if not rows:
        return logits
    bits = torch.from_numpy(np.stack([guides[row].allowed(outputs[row])  # type: ignore[union-attr]
                                      for row in rows]).view(np.int32))
    masked = logits.clone()
    kernels = cpu_kernels() if logits.device.type == "cpu" and \
        logits.dtype == torch.float32 else None
    (kernels.mask_rows if kernels is not None else mask_rows)(masked, torch.tensor(rows), bits)
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

