"""Tokenizers of other families than the default model's, built here (nothing can be
downloaded): for tests of what depends on how a tokenizer's text is made."""

from __future__ import annotations

import functools
import json

from shared.engine.tokenizer import TextTokenizer


@functools.cache
def spm_like(add_bos: bool = False) -> TextTokenizer:
    """A SentencePiece-style tokenizer (Llama 2's, Mistral's tokenizer.json: a Metaspace
    pre-tokenizer, byte fallback, a decoder that strips the text's leading space), trained
    here on HumanEval's text; `add_bos`: raw text encoded with special tokens begins with
    <s>, as Llama 2's does."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    from distserve.bench.workload import humaneval_prompts

    def build(model: models.Model) -> Tokenizer:
        tokenizer = Tokenizer(model)
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                                     normalizers.Replace(" ", "▁")])
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
        tokenizer.decoder = decoders.Sequence([
            decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
            decoders.Strip(" ", 1, 0)])
        return tokenizer

    trained = build(models.BPE(unk_token="<unk>"))
    trained.train_from_iterator([p + s for p, s in humaneval_prompts()], trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"]))
    learned = json.loads(trained.to_str())["model"]
    vocab = dict(learned["vocab"])
    for i in range(256):  # byte fallback's tokens, in the model's own vocabulary
        vocab.setdefault(f"<0x{i:02X}>", len(vocab))
    inner = build(models.BPE(vocab, [tuple(m) for m in learned["merges"]], unk_token="<unk>",
                             byte_fallback=True))
    inner.add_special_tokens(["<unk>", "<s>", "</s>"])
    if add_bos:
        inner.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", inner.token_to_id("<s>"))])
    return TextTokenizer(inner, bos_token="<s>", eos_token="</s>", eos_ids=[2])
