"""The tokenizer and chat template: a Hugging Face directory's own, or a byte-level BPE built
from the data inside a GGUF file."""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
)

from shared.engine.gguf_loader import TokenizerData

ChatMessage = dict[str, Any]  # role and content; tool_calls, tool_call_id, name where given


class ChatTemplateError(ValueError):
    """The model has no chat template, or the messages do not fit it."""


# the pre-tokenizer regexes of the BPE vocabularies GGUF files name in tokenizer.ggml.pre
# (the same as the models' tokenizer.json); GPT-2's is ByteLevel's own
PRE_TOKENIZER_PATTERNS = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
             r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
                 r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


GPT2_PRE_TOKENIZERS = ("default", "gpt2", "smollm")  # GPT-2's regex (smollm: digits split)


def _gpt2_byte_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: each byte as a printable character (the printable
    Latin-1 ones as themselves, the others from U+0100 on)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


BYTE_OF_CHAR = _gpt2_byte_chars()
BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def raise_exception(message: str) -> None:
    """Chat templates call it to refuse messages they cannot render (as in transformers)."""
    raise ChatTemplateError(message)


def strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
           separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' tojson: plain JSON, not jinja's HTML-escaped one."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class TextTokenizer:
    """Text to ids and back, and the chat template, over a `tokenizers` tokenizer: the one a
    Hugging Face directory ships (`tokenizer.json`) or one built from a GGUF's vocabulary."""

    def __init__(self, tokenizer: Tokenizer, *, chat_template: str | None = None,
                 bos_token: str | None = None, eos_token: str | None = None,
                 eos_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self.bos_token, self.eos_token = bos_token, eos_token
        # every id that ends a generation; eos_id is the template's EOS (the first)
        self.eos_ids = frozenset(eos_ids)
        self.eos_id = eos_ids[0] if eos_ids else None
        self.bos_id = None if bos_token is None else tokenizer.token_to_id(bos_token)
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._pieces: dict[int, tuple[str, bytes]] = {}  # token_piece's
        # the environment transformers renders chat templates in
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals |= {"raise_exception": raise_exception, "strftime_now": strftime_now}
        self.chat_template = chat_template  # its source (what it teaches: tool calls)
        try:
            self._template = env.from_string(chat_template) if chat_template else None
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the model's chat template does not compile: {e}") from e

    @classmethod
    def from_gguf(cls, data: TokenizerData) -> TextTokenizer:
        vocab = {token: i for i, token in enumerate(data.tokens)}
        merges = [(a, b) for a, b in (m.split(" ", 1) for m in data.merges)]
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        pattern = PRE_TOKENIZER_PATTERNS.get(data.pre)
        if pattern is None and data.pre not in GPT2_PRE_TOKENIZERS:
            raise ValueError(f"the GGUF's pre-tokenizer {data.pre!r} is not supported "
                             f"({', '.join([*GPT2_PRE_TOKENIZERS, *PRE_TOKENIZER_PATTERNS])})")
        if pattern is not None:
            pre = [pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        else:
            # llama.cpp's "smollm" pre-tokenizer splits digits one by one before GPT-2's regex
            digits = [pre_tokenizers.Digits(individual_digits=True)] if data.pre == "smollm" \
                else []
            pre = [*digits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(pre)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in data.special_tokens]
        )
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                              for t in data.user_tokens])
        bos = None if data.bos_id is None else data.tokens[data.bos_id]
        if data.add_bos and bos is not None:
            tokenizer.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", special_tokens=[(bos, data.bos_id)])
        return cls(tokenizer, chat_template=data.chat_template, bos_token=bos,
                   eos_token=data.tokens[data.eos_id], eos_ids=[data.eos_id, *data.stop_ids])

    def to_json(self) -> str:
        """The tokenizer as `tokenizers` saves it (tokenizer.json's text)."""
        return self._tokenizer.to_str()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """`add_special_tokens`: what the model's tokenizer adds around raw text (Llama 3's
        BOS), for a prompt given as text; a chat template writes its own."""
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_piece(self, token_id: int) -> tuple[str, bytes]:
        """A token as logprobs show it: its text, or OpenAI's `bytes:\\xe2\\x80` where its
        bytes are part of a character; and its bytes (cached: a vocabulary's at most)."""
        piece = self._pieces.get(token_id)
        if piece is None:
            raw = self.token_bytes(token_id)
            try:
                text = raw.decode()
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            piece = self._pieces[token_id] = (text, raw)
        return piece

    def context_of(self, prompt: Sequence[int]) -> list[int]:
        """The ids an output is decoded after (IncrementalDetokenizer's context): the
        prompt's last token that shows in text (among its last 8), from where its character
        begins: a token of a character's last bytes alone (a SentencePiece byte fallback's
        <0xAD> of 中) would decode with the output's first bytes as replacement characters."""
        shown = [t for t in prompt[-8:] if self.in_text(t)]
        start = len(shown) - 1
        while start > 0 and 0x80 <= (self.token_bytes(shown[start])[:1] or b"\0")[0] < 0xC0:
            start -= 1  # it begins inside a character: the token before it too
        return shown[max(start, 0):]

    def in_text(self, token_id: int) -> bool:
        """Whether generated text shows the token (`decode` leaves special tokens out)."""
        return token_id not in self._special_ids

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self._tokenizer.get_added_tokens_decoder().items()
                         if t.special)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for, which may be part of a character (a byte-level
        BPE piece, a SentencePiece byte fallback `<0xE2>`): what OpenAI's logprobs give as
        `bytes`, so that a client joins a split character's bytes again."""
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and piece not in self._added:
            with contextlib.suppress(KeyError):  # a piece outside the alphabet: as text
                return bytes(BYTE_OF_CHAR[c] for c in piece)
        if piece in self._added:
            return piece.encode()
        if (byte := BYTE_FALLBACK.fullmatch(piece)) is not None:
            return bytes([int(byte[1], 16)])
        return piece.replace("▁", " ").encode()  # SentencePiece's word boundary

    @functools.cached_property
    def _byte_level(self) -> bool:
        """Whether the decoder maps each character of a piece to a byte (GPT-2's)."""
        decoder = json.loads(self._tokenizer.to_str()).get("decoder") or {}
        kinds = [d.get("type") for d in decoder.get("decoders", [decoder])]
        return "ByteLevel" in kinds

    @functools.cached_property
    def _added(self) -> frozenset[str]:
        return frozenset(t.content for t in self._tokenizer.get_added_tokens_decoder().values())

    def apply_chat_template(self, messages: Sequence[ChatMessage],
                            tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """Render messages as the model's chat prompt, ending with the assistant's turn;
        `tools`: the functions it may call, as OpenAI's requests give them (templates that
        know tools show them to the model)."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template")
        try:
            return str(self._template.render(
                messages=list(messages), add_generation_prompt=True,
                tools=list(tools) if tools else None,
                documents=None, eos_token=self.eos_token or "", bos_token=self.bos_token or ""))
        except ChatTemplateError:
            raise
        except Exception as e:  # a template's own error, or any its expressions
            # raise on values it did not expect (a number where it joins strings, a range
            # too large): the messages' fault, never the server's
            raise ChatTemplateError(f"the model's chat template cannot render these messages: "
                                    f"{type(e).__name__}: {e}") from e


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, holding back incomplete UTF-8.

    Each update decodes a window of the last ids, not the whole list (which made a request's
    n-th token cost O(n), a long generation O(n^2)): the ids of the last delta, for context,
    then the new ones; the delta is what the new ones add to the context's text. Windows
    start and end where a character does, so the deltas add up to the whole list's text
    (a decoder that strips a leading space strips it from both decodes alike) where the ids
    spell valid UTF-8; bytes that never make a character come out as replacement
    characters either way, not always as many. A window grows only while its end is such a
    partial character or its ids add no text (skipped special tokens)."""

    def __init__(self, tokenizer: TextTokenizer, context: Sequence[int] = ()) -> None:
        """`context`: ids before the first one (the prompt's last), decoded with the first
        window only for context: a decoder that strips the text's leading space
        (SentencePiece's) then strips none of the output's, which goes on from its prompt
        (' Paris' after 'The capital of France is', as the prompt and the text read
        together)."""
        self._tokenizer = tokenizer
        self._context = list(context)
        self.text = ""
        # in ids as the context and the output together: the window's first id (the last
        # delta's, decoded for context), and the end of those in `text`
        self._start, self._read = 0, len(self._context)

    def update(self, ids: Sequence[int]) -> str:
        return self._take(ids, len(self._context) + len(ids))

    def streamed(self, ids: Sequence[int]) -> None:
        """Take `ids` as a stream showed them, one token at a time: a request resumed from
        the tokens another engine streamed, whose `text` must be what the client has. Taken
        at once, ids that end inside a character would add nothing (the whole window is
        held back), and the text the client already has would be shown again."""
        for end in range(self._read + 1, len(self._context) + len(ids) + 1):
            self._take(ids, end)

    def _window(self, ids: Sequence[int], start: int, end: int) -> list[int]:
        """[start, end) of the context and `ids` together."""
        n = len(self._context)
        return self._context[start:end] + list(ids[max(0, start - n):max(0, end - n)])

    def _take(self, ids: Sequence[int], end: int) -> str:
        context = self._tokenizer.decode(self._window(ids, self._start, self._read))
        text = self._tokenizer.decode(self._window(ids, self._start, end))
        # a multi-byte character not complete yet, or ids that add no text (yet)
        if len(text) <= len(context) or text.endswith("\ufffd"):
            return ""
        delta = text[len(context):]
        self._start, self._read = self._read, end
        self.text += delta
        return delta
