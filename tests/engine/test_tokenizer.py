from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from shared.engine.engine import TextState
from shared.engine.gguf_loader import read_gguf_tokenizer
from shared.engine.meta import read_tokenizer
from shared.engine.tokenizer import ChatTemplateError, IncrementalDetokenizer, TextTokenizer
from tests.tokenizers import spm_like

SHAREGPT = Path(__file__).parents[3] / "shared" / "data" / "sharegpt_v3_filtered_1000_prompts.json"


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return read_tokenizer("smollm2-135m")


def test_round_trip_and_special_tokens(tok: TextTokenizer) -> None:
    text = "héllo wörld 日本語 🎉\n\tcode()"
    assert tok.decode(tok.encode(text)) == text
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and tok.eos_id in ids  # control tokens are single ids
    assert tok.decode(ids) == "user\nhi"  # and skipped when decoding


def test_digits_split_one_by_one(tok: TextTokenizer) -> None:
    # llama.cpp's "smollm" pre-tokenizer (and the original tokenizer.json) split digits
    assert [tok.decode([i]) for i in tok.encode("2024")] == ["2", "0", "2", "4"]


@pytest.mark.slow
def test_matches_hf_tokenizer_on_real_prompts(tok: TextTokenizer) -> None:
    """HF's GGUF converter drops the digit split, so compare on prompts without digits."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    from shared.engine.gguf_loader import resolve_gguf_path

    path = resolve_gguf_path("smollm2-135m")
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    prompts = [p["conversations"][0]["value"] for p in json.loads(SHAREGPT.read_text())]
    texts = [p for p in prompts if not any(c.isdigit() for c in p)][:200]
    assert len(texts) > 100
    for text in texts:
        assert tok.encode(text) == hf(text, add_special_tokens=False).input_ids
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


def test_incremental_detokenizer_holds_back_partial_utf8(tok: TextTokenizer) -> None:
    ids = tok.encode("a 🎉 b")
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.update(ids[: i + 1]) for i in range(len(ids))]
    assert "".join(pieces) == "a 🎉 b"
    assert all("\ufffd" not in p for p in pieces)


def test_raw_text_gets_the_tokenizers_own_special_tokens_on_request(tok: TextTokenizer) -> None:
    """A tokenizer.json whose post-processor adds a BOS (as Llama 3's does): a completion's raw
    prompt gets it, a chat prompt (whose template writes it) does not get it twice."""
    from tokenizers import Tokenizer, processors

    inner = Tokenizer.from_str(tok._tokenizer.to_str())
    inner.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    with_bos = TextTokenizer(inner, bos_token="<|im_start|>", eos_token="<|im_end|>",
                             eos_ids=[2])
    plain = tok.encode("Hello")
    assert with_bos.encode("Hello", add_special_tokens=True) == [1, *plain]
    assert with_bos.encode("Hello") == plain
    assert with_bos.bos_id == 1 and with_bos.eos_ids == {2}


def test_chat_templates_render_as_in_transformers(tok: TextTokenizer) -> None:
    """loop controls, plain tojson, tools (None unless given), and raise_exception as a
    ChatTemplateError."""
    template = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                "{{ m | tojson }}{% endfor %}{% if tools is not none %}"
                "TOOLS{% for t in tools %} {{ t.function.name }}{% endfor %}{% endif %}"
                "{% if messages | length > 2 %}{{ raise_exception('too many') }}{% endif %}")
    t = TextTokenizer(tok._tokenizer, chat_template=template, eos_token="<|im_end|>",
                      eos_ids=[2])
    one = {"role": "user", "content": "<b>&'"}
    assert t.apply_chat_template([one, one]) == '{"role": "user", "content": "<b>&\'"}'
    tools = [{"type": "function", "function": {"name": "f"}},
             {"type": "function", "function": {"name": "g"}}]
    assert t.apply_chat_template([one], tools).endswith("TOOLS f g")
    assert "TOOLS" not in t.apply_chat_template([one], [])
    with pytest.raises(ChatTemplateError, match="too many"):
        t.apply_chat_template([one, one, one])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        TextTokenizer(tok._tokenizer).apply_chat_template([one])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        TextTokenizer(tok._tokenizer, chat_template="{% for %}")


def test_a_gguf_pre_tokenizer_we_do_not_know_is_refused() -> None:
    """Not silently GPT-2's regex: the tokens would differ from the model's."""
    data = read_gguf_tokenizer("smollm2-135m")
    with pytest.raises(ValueError, match="pre-tokenizer 'deepseek-r1-qwen' is not supported"):
        TextTokenizer.from_gguf(dataclasses.replace(data, pre="deepseek-r1-qwen"))


MIXED = " Ünïcödé, 中文字符 and 🎉🎉 — ∑x² ends.\n\tdone"


@pytest.mark.parametrize("kind", ["byte-level BPE", "SentencePiece-like"])
def test_incremental_deltas_add_up_to_the_text_decoding_a_few_ids_a_token(
        kind: str, tok: TextTokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Token by token over real text in several scripts (byte-fallback and multi-byte
    characters included): the deltas make the whole list's text, none holds a partial
    character, and no update decodes more than a few ids, so a long generation's n-th token
    costs what its first did (the detokenizer decoded all n ids each time)."""
    from distserve.bench.workload import humaneval_prompts

    tokenizer = tok if kind == "byte-level BPE" else spm_like()
    text = "".join(p + s for p, s in humaneval_prompts()[:4]) + MIXED
    ids = tokenizer.encode(text)
    assert len(ids) > 400
    whole = tokenizer.decode(ids)
    assert whole.endswith("∑x² ends.\n\tdone")
    windows: list[int] = []
    decode = tokenizer.decode

    def counted(window: list[int], skip_special_tokens: bool = True) -> str:
        windows.append(len(window))
        return decode(window, skip_special_tokens)
    monkeypatch.setattr(tokenizer, "decode", counted)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.update(ids[: i + 1]) for i in range(len(ids))]
    assert "".join(pieces) == detok.text == whole
    assert all("\ufffd" not in p for p in pieces)
    assert max(windows) <= 8, max(windows)


@pytest.mark.parametrize("kind", ["byte-level BPE", "SentencePiece-like"])
def test_each_tokens_bytes_join_into_the_texts(kind: str, tok: TextTokenizer) -> None:
    """A token's bytes (OpenAI's logprobs `bytes`) may be part of a character; the tokens'
    bytes together are the text's, where decoding a token alone gives U+FFFD."""
    tokenizer = tok if kind == "byte-level BPE" else spm_like()
    ids = tokenizer.encode(MIXED)
    alone = [tokenizer.decode([t]) for t in ids]
    assert any("\ufffd" in a for a in alone)  # some token splits a character
    joined = b"".join(tokenizer.token_bytes(t) for t in ids)
    prefix = b" " if kind == "SentencePiece-like" else b""  # its normalizer's "▁"
    assert joined == prefix + MIXED.encode()
    pieces = [tokenizer.token_piece(t) for t in ids]
    assert all(text == piece.decode() for text, piece in pieces
               if not text.startswith("bytes:"))
    split = [(text, piece) for text, piece in pieces if text.startswith("bytes:")]
    assert split and all(text == "bytes:" + "".join(f"\\x{b:02x}" for b in piece)
                         for text, piece in split)  # OpenAI's form of a partial character
    im_end = tokenizer.encode("<|im_end|>") if kind == "byte-level BPE" else [2]
    assert tokenizer.token_bytes(im_end[0]) == (b"<|im_end|>" if kind == "byte-level BPE"
                                                 else b"</s>")


@pytest.mark.parametrize("stop", [(), ("<|never|>",)], ids=["no-stop", "stop-held-back"])
def test_a_stream_resumed_elsewhere_shows_the_rest_of_its_text_once(
        tok: TextTokenizer, stop: tuple[str, ...]) -> None:
    """A request moved mid-stream goes on in an engine given the tokens it streamed: that
    engine shows the rest of the text, once, wherever the cut falls; also inside a character
    that several tokens spell (the whole text was shown again there, found on a GPU run of
    the failover tests), and with text held back for a stop string."""
    ids = tok.encode(" lowest gest aligned 🎉🙂 done é!")
    whole = TextState(tok, stop)
    shown = [whole.advance(ids[:n])[0] for n in range(1, len(ids) + 1)]
    text = "".join(shown) + whole.flush()
    assert text == " lowest gest aligned 🎉🙂 done é!"
    inside = [cut for cut in range(1, len(ids)) if tok.decode(ids[:cut]).endswith("\ufffd")]
    assert len(inside) >= 2  # cuts within a character are among those tried
    for cut in range(1, len(ids)):
        resumed = TextState(tok, stop, ids[:cut])
        rest = [resumed.advance(ids[:n])[0] for n in range(cut + 1, len(ids) + 1)]
        assert "".join(shown[:cut]) + "".join(rest) + resumed.flush() == text, cut


@pytest.mark.parametrize("kind", ["byte-level BPE", "SentencePiece-like"])
def test_an_output_reads_on_from_its_prompt(kind: str, tok: TextTokenizer) -> None:
    """The text of an output is what it adds to its prompt's: ' Paris' after 'The capital
    is', where a SentencePiece decoder, decoding the output alone, strips its leading space
    ('Paris': the prompt and the text read together 'isParis'). Its prompt's last token
    that shows in text is its context; a prompt of special tokens only gives none."""
    tokenizer = tok if kind == "byte-level BPE" else spm_like()
    ids = tokenizer.encode("The capital is Paris, it is said")
    cut = next(i for i in range(1, len(ids))
               if tokenizer.decode(ids[:i]).endswith("is") and
               tokenizer.token_piece(ids[i])[0].startswith(" "))
    prompt, output = ids[:cut], ids[cut:]
    expected = tokenizer.decode(ids)[len(tokenizer.decode(prompt)):]
    assert expected.startswith(" Paris")
    state = TextState(tokenizer, (), prompt=prompt)
    text = "".join(state.advance(output[:n])[0] for n in range(1, len(output) + 1))
    assert text + state.flush() == expected
    alone = TextState(tokenizer, (), prompt=[t for t in prompt if not tokenizer.in_text(t)])
    text = "".join(alone.advance(output[:n])[0] for n in range(1, len(output) + 1))
    assert text + alone.flush() == tokenizer.decode(output)  # stripped, as decoded alone
    resumed = TextState(tokenizer, (), output[:3], prompt=prompt)  # a move after 3 tokens
    rest = "".join(resumed.advance(output[:n])[0] for n in range(4, len(output) + 1))
    assert rest + resumed.flush() == expected[len(tokenizer.decode(prompt + output[:3])) -
                                              len(tokenizer.decode(prompt)):]


@pytest.mark.parametrize(("prompt", "output"), [("The word 中", "文 means"), ("café", "é ok"),
                                                ("emoji 😀", "😀😀 ok")])
def test_an_output_after_a_prompt_ending_in_byte_tokens_reads_whole(prompt: str,
                                                                    output: str) -> None:
    """A prompt that ends in a character the vocabulary spells in byte-fallback tokens:
    the output's context begins where that character does (its last byte alone, decoded
    with the output's first bytes, made replacement characters of them, or nothing)."""
    tokenizer = spm_like()
    ids = tokenizer.encode(prompt + output)
    cut = len(tokenizer.encode(prompt))
    assert ids[:cut] == tokenizer.encode(prompt)
    assert tokenizer.token_piece(ids[cut - 1])[0].startswith("bytes:")  # a byte token
    expected = tokenizer.decode(ids)[len(tokenizer.decode(ids[:cut])):]
    assert "\ufffd" not in expected and expected.endswith(output.split()[-1])
    state = TextState(tokenizer, (), prompt=ids[:cut])
    text = "".join(state.advance(ids[cut:n])[0] for n in range(cut + 1, len(ids) + 1))
    assert text + state.flush() == expected
