"""Byte-level BPE tokenizer and chat template, built from the data inside a GGUF file."""

from __future__ import annotations

from collections.abc import Sequence

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from shared.engine.gguf_loader import TokenizerData

ChatMessage = dict[str, str]


class ChatTemplateError(ValueError):
    """The model has no chat template, or the messages do not fit it."""


class TextTokenizer:
    def __init__(self, data: TokenizerData) -> None:
        vocab = {token: i for i, token in enumerate(data.tokens)}
        merges = [(a, b) for a, b in (m.split(" ", 1) for m in data.merges)]
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        # llama.cpp's "smollm" pre-tokenizer splits digits one by one before the GPT-2 regex.
        splits = [pre_tokenizers.Digits(individual_digits=True)] if data.pre == "smollm" else []
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in data.special_tokens]
        )
        self._tokenizer = tokenizer
        self._data = data
        self.eos_id = data.eos_id
        self.bos_id = data.bos_id
        self.vocab_size = len(data.tokens)
        self._template = (
            ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
                data.chat_template
            )
            if data.chat_template
            else None
        )

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: Sequence[ChatMessage]) -> str:
        """Render messages as the model's chat prompt, ending with the assistant's turn."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template")
        eos = self._data.tokens[self.eos_id]
        bos = "" if self.bos_id is None else self._data.tokens[self.bos_id]
        return str(
            self._template.render(
                messages=list(messages), add_generation_prompt=True, eos_token=eos, bos_token=bos
            )
        )


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, holding back incomplete UTF-8."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tokenizer = tokenizer
        self.text = ""

    def update(self, ids: Sequence[int]) -> str:
        text = self._tokenizer.decode(ids)
        if text.endswith("\ufffd"):  # a multi-byte character is not complete yet
            return ""
        delta = text[len(self.text) :]
        self.text = text
        return delta
