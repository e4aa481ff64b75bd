"""Structured output: an answer held to a format (a JSON schema, OpenAI's `response_format`;
a regex, a choice or a grammar, vLLM's `structured_outputs`), token by token, with
llguidance's matcher.

The gateway turns a format into a grammar (`json_grammar`, `regex_grammar`,
`choice_grammar`, `text_grammar`), checks that an answer can begin within it under LIMITS
(`Guides.check`, off its event loop) and sends it with the request's sampling; an engine
gives each request that has one a `Guide` when it takes the request in, and masks the
tokens the grammar does not allow at every token it samples (`masks` here, no torch: the
gateway checks grammars without it; applied to the logits by sampler.constrain). A guide feeds
itself the request's output tokens as they come, whoever sampled them: the first token on a
prefill instance, the rest on a decode instance, the tokens a failed-over request streamed
before elsewhere. So the grammar travels as text and no matcher state crosses a process.

Once the grammar is complete only an end-of-sequence token is allowed, so the answer stops
there ("stop"), or at max_tokens before ("length", unfinished, as OpenAI's).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from llguidance import LLExecutor, LLMatcher, LLParserLimits, LLTokenizer, grammar_from

from shared.engine.tokenizer import TextTokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

log = logging.getLogger(__name__)

# the JSON text's layout: Python's json.dumps' (", " and ": ", no newlines); whitespace left
# free is where a small model can wander, a blank line at a time, until its tokens run out
LAYOUT: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ",
                              "key_separator": ": "}


# a grammar travels in the request's messages (NATS takes 1 MB a message): OpenAI's own
# bounds on a schema (100 properties, 15,000 characters of names and values) fit in far less
MAX_GRAMMAR_BYTES = 64 << 10
# What one request's grammar may cost, at most, on the engine's thread (llguidance's
# defaults let a 40-byte pattern, a{700}{700}, take a second a mask and 0.16 s every token
# after): its compile (symbols, lexer states) and each mask (lexer fuel ~14k/ms, Earley
# items ~20k/ms: ~4 ms). The first mask gets more: it builds the lexer's first states. A
# grammar past them is refused at the gateway, which compiles it and computes its first
# mask under the same limits; one that outgrows them later fails its request (`Guide`).
LIMITS = LLParserLimits(max_grammar_size=20_000, max_lexer_states=50_000,
                        initial_lexer_fuel=200_000, step_lexer_fuel=50_000,
                        step_max_items=20_000, verbose_errors=False)


def json_grammar(schema: dict[str, Any] | str | None, strict: bool = False) -> str:
    """The grammar of JSON text valid against `schema` (its text, or None: any JSON object,
    OpenAI's json_object). Not `strict`: keywords llguidance does not implement are ignored
    (the answer is still JSON); `strict`: they are errors (`Guides.check`), whatever the
    schema's own `x-guidance` says. ValueError: it is no JSON object, or too large."""
    def build() -> str:
        text = schema if isinstance(schema, str) else json.dumps(
            {"type": "object"} if schema is None else schema)
        return LLMatcher.grammar_from_json_schema(
            _bounded(text, "schema"), defaults=LAYOUT, overrides={"lenient": not strict})
    return _built(build, "schema")


def json_items_grammar(alternatives: Sequence[tuple[str, dict[str, Any], str]],
                       before: str, after: str, between: str, most: int = 1,
                       strict: bool = False) -> str:
    """The grammar of an item, or of up to `most` with `between` each two (a small model
    would repeat one until its tokens ran out): `before`, one of the `alternatives` (a text,
    JSON valid against a schema, a text: a tool call's), `after`. Each schema is a root of
    its own, so a `$ref` in it resolves inside it."""
    def text(literal: str) -> list[str]:
        return [json.dumps(literal)] if literal else []

    def build() -> str:
        options = LAYOUT | {"lenient": not strict}
        lines = ["start: item" + (f" ({json.dumps(between)} item){{0,{most - 1}}}"
                                  if most > 1 else ""),
                 " ".join(["item:", *text(before), "one", *text(after)]),
                 "one: " + " | ".join(f"alt{i}" for i in range(len(alternatives)))]
        lines += [" ".join([f"alt{i}:", *text(pre), "%json " + json.dumps(
            schema | {"x-guidance": options}), *text(post)])
            for i, (pre, schema, post) in enumerate(alternatives)]
        return LLMatcher.grammar_from_lark(
            _bounded("\n".join(lines), "tool set"))
    return _built(build, "tool set")


def regex_grammar(regex: str) -> str:
    """The grammar of text the whole of which `regex` matches (Rust's regex syntax)."""
    return _built(lambda: LLMatcher.grammar_from_regex(_bounded(regex, "regex")), "regex")


def choice_grammar(choices: Sequence[str]) -> str:
    """The grammar of exactly one of `choices`."""
    if not choices or any(not choice for choice in choices):
        raise ValueError("choice takes one or more non-empty strings")
    lark = "start: " + " | ".join(json.dumps(choice) for choice in choices)
    return _built(lambda: LLMatcher.grammar_from_lark(_bounded(lark, "choice")), "choice")


def text_grammar(grammar: str) -> str:
    """A context-free grammar given as text: Lark's syntax (llguidance's) or llama.cpp's
    GBNF (converted)."""
    return _built(lambda: grammar_from("grammar", _bounded(grammar, "grammar")), "grammar")


def _bounded(text: str, what: str) -> str:
    if len(text.encode()) > MAX_GRAMMAR_BYTES:
        raise ValueError(f"the {what} is too large ({len(text.encode())} bytes; at most "
                         f"{MAX_GRAMMAR_BYTES})")
    return text


def _built(build: Callable[[], str], what: str) -> str:
    """The grammar `build` makes, bounded; ValueError says what is wrong with its input."""
    try:
        grammar = build()
    except ValueError:
        raise
    except Exception as e:  # the converters' own: a parse error, a schema nested too deep
        raise ValueError(f"{type(e).__name__}: {e}") from None
    return _bounded(grammar, f"{what} as a grammar")


def _reason(error: str) -> str:
    """llguidance's error in a line (of at most 400 characters)."""
    if error.startswith("NoExtension"):
        return "no text satisfies it"
    lines = [line.strip() for line in error.splitlines()
             if line.strip() and line.strip() != "<non-verbose/>"]
    said = " ".join(lines) or "an error"
    return said if len(said) <= 400 else said[:397] + "..."


class Guide:
    """One request's grammar: its matcher, fed the request's output tokens up to those it
    has seen. `failure`: why the grammar could not go on (it outgrew the limits, or nothing
    can follow), which fails the request (an end of sequence ends it at once)."""

    def __init__(self, matcher: LLMatcher, ends: np.ndarray) -> None:
        self.matcher, self.ends = matcher, ends
        self.fed = 0
        self.failure: str | None = None

    def feed(self, output_ids: Sequence[int]) -> bool:
        """Give the matcher the output tokens it has not seen; whether it can mask the next
        one. A token the grammar refused (none drawn within it is: a resumed request's from
        elsewhere, a grammar whose parse outgrew the limits) puts it in error, which fails
        the request (`masked`)."""
        new = list(output_ids[self.fed:])
        self.fed = len(output_ids)
        if new and not self.matcher.is_error() and not self.matcher.consume_tokens(new):
            log.warning("the grammar refused a token: %s", _reason(self.matcher.get_error()))
        return not self.matcher.is_error()

    def masked(self, words: np.ndarray) -> np.ndarray:
        """The mask computed into `words` (uint32, a bit a token), or the end of sequence
        alone where computing it failed, recorded as the request's `failure`."""
        if self.matcher.is_error() or not words.any():
            self.failure = f"the answer could not be held to its format after {self.fed} " \
                           f"tokens: {_reason(self.matcher.get_error())}"
            return self.ends
        return words


@functools.lru_cache(maxsize=8)
def _ll_tokenizer(tokenizer: TextTokenizer, vocab: int) -> LLTokenizer | str:
    """llguidance's view of a tokenizer (~0.3 s for 49k tokens, so once a process), or why
    it cannot have one."""
    try:
        return LLTokenizer(tokenizer.to_json(), n_vocab=vocab,
                           eos_token=sorted(tokenizer.eos_ids) or None)
    except Exception as e:  # a tokenizer llguidance cannot read, no EOS
        log.warning("answers held to a format are not served: %s", e)
        return f"{type(e).__name__}: {e}"


class Guides:
    """The guides of one model's requests: llguidance's tokenizer (built on the first
    request with a grammar), the grammars compiled lately, and a guide for each request.
    `vocab`: the model's (its logits may be wider than the tokenizer: those ids are never
    allowed).

    A grammar is compiled, and its first mask computed (the lexer's first states: most of a
    heavy grammar's cost), once: `compiled` keeps the matcher (or why it failed) for the next
    request of the same format (a client's schema, sent again and again; the n choices of
    one request), and each request's guide is a copy of it (~0 ms). The workers compile a
    new grammar off the engine's thread (`Engine.prepare`) before the engine takes the
    request in, so a step waits on no compile."""

    def __init__(self, tokenizer: TextTokenizer, vocab: int = 0, cached: int = 64) -> None:
        self.text_tokenizer = tokenizer
        self.vocab = max(vocab, tokenizer.vocab_size)
        self.ends = np.zeros((self.vocab + 31) // 32, dtype=np.uint32)
        for end in tokenizer.eos_ids:
            self.ends[end // 32] |= np.uint32(1 << (end % 32))
        self.cached = cached
        self._compiled: OrderedDict[str, LLMatcher | str] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> LLTokenizer:
        built = _ll_tokenizer(self.text_tokenizer, self.vocab)
        if isinstance(built, str):
            raise ValueError(f"answers held to a format are not served for this model's "
                             f"tokenizer ({built})")
        return built

    def compiled(self, grammar: str) -> LLMatcher:
        """`grammar` compiled and its first mask computed, within LIMITS (any thread), from
        the cache or now; ValueError unless an answer can begin within it (it does not
        compile, or allows no first token)."""
        with self._lock:
            hit = self._compiled.get(grammar)
            if hit is not None:
                self._compiled.move_to_end(grammar)
        if hit is None:
            hit = self._compile(grammar)  # the lock not held: others' hits go on
            with self._lock:
                self._compiled[grammar] = hit
                while len(self._compiled) > self.cached:
                    self._compiled.popitem(last=False)
        if isinstance(hit, str):
            raise ValueError(hit)
        return hit

    def _compile(self, grammar: str) -> LLMatcher | str:
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0, limits=LIMITS)
        if not matcher.is_error():
            first = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)
            if not matcher.is_error() and first.any():
                return matcher
        return _reason(matcher.get_error())

    def guide(self, grammar: str) -> Guide:
        """A new request's guide: a copy of the compiled grammar; ValueError as `compiled`."""
        return Guide(self.compiled(grammar).deep_copy(), self.ends)

    def check(self, grammar: str) -> None:
        """ValueError unless an answer can begin within `grammar` (the gateway's check)."""
        self.compiled(grammar)


@functools.cache
def _executor() -> LLExecutor:
    """llguidance's threads: its default (80% of the CPUs) is one on two cores, where two
    halve a batch's masks."""
    return LLExecutor(num_threads=max(2, min(32, int(0.8 * (os.cpu_count() or 1)))))


def masks(guides: Sequence[Guide], outputs: Sequence[Sequence[int]]) -> np.ndarray:
    """Each guide's mask for the token after its outputs ([guides, words] uint32, a bit a
    token), computed together on llguidance's threads (the GIL let go)."""
    words = guides[0].ends.shape[0]
    bits = np.zeros((len(guides), words), dtype=np.uint32)
    live = [(guide.matcher, i) for i, (guide, ids) in enumerate(zip(guides, outputs, strict=True))
            if guide.feed(ids)]
    if live:
        _executor().unsafe_compute_mask_ptr(live, bits.ctypes.data, words * 4, len(guides))
    for i, guide in enumerate(guides):
        bits[i] = guide.masked(bits[i])
    return bits
