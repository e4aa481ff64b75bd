"""Answers held to a JSON schema (structured.py): every token drawn within the grammar, on one
engine, across a KV transfer and after a failover's resume; the logprobs the model's own."""

from __future__ import annotations

import json
from typing import Any

import jsonschema_rs
import pytest
import torch

from shared.engine.config import EngineConfig, Role
from shared.engine.engine import Engine, RequestRejected
from shared.engine.kernels import cpu_kernels
from shared.engine.loader import LoadedModel
from shared.engine.request import Request, SamplingParams
from shared.engine.structured import (
    MAX_GRAMMAR_BYTES,
    Guides,
    constrain,
    json_grammar,
    mask_rows,
)
from shared.engine.tokenizer import TextTokenizer
from tests.engine.conftest import prefill_then_decode

PERSON = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "city", "pets"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"enum": ["Paris", "Rome", "Lima"]},
                         "pets": {"type": "array", "items": {"type": "string"},
                                  "maxItems": 2}}}
ASK = "Describe a person as JSON: name, age, city and pets."


def engine(loaded: LoadedModel, **scheduler: object) -> Engine:
    return Engine(EngineConfig().with_scheduler(**scheduler), loaded)


def run(e: Engine) -> None:
    while e.has_work():
        e.step()


@pytest.fixture(scope="module")
def ask(tokenizer: TextTokenizer) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": ASK}]))


def guided(max_tokens: int = 80, **sampling: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, grammar=json_grammar(PERSON), **sampling)


def answer(e: Engine, request: Request) -> Any:
    assert e.tokenizer is not None
    value = json.loads(e.tokenizer.decode(request.output_ids))
    jsonschema_rs.validate(PERSON, value)
    return value


def test_every_answer_is_json_of_the_schema_beside_unguided_rows(
        loaded: LoadedModel, ask: list[int]) -> None:
    """Greedy and sampled (four seeds) answers in one batch are each JSON valid against the
    schema and end there ("stop"); an unguided request in the same steps is what it is alone
    (the mask is its row's only)."""
    e = engine(loaded)
    free = SamplingParams(max_tokens=40)
    alone = e.generate([ask], free)[0].output_ids
    requests = [e.add_request("greedy", ask, guided()), e.add_request("free", ask, free)] + \
        [e.add_request(f"s{seed}", ask, guided(temperature=1.0, seed=seed))
         for seed in range(4)]
    run(e)
    assert requests[1].output_ids == alone
    assert alone[0] != requests[0].output_ids[0]  # unguided, it starts another way
    for request in requests[:1] + requests[2:]:
        answer(e, request)
        assert request.finish_reason == "stop"
        assert request.output_ids[-1] in e.eos_ids
    assert len({tuple(r.output_ids) for r in requests[2:]}) > 1  # sampled, not one answer


def test_the_logprobs_are_the_models_not_the_masks(loaded: LoadedModel,
                                                   ask: list[int]) -> None:
    """A guided answer's logprobs are those the model gives its tokens (the same tokens
    scored as a prompt, unguided), not the renormalised mask's: a forced token is not 0."""
    e = engine(loaded)
    request = e.generate([ask], guided(logprobs=True))[0]
    tokens = request.output_ids[:-1]  # not the EOS
    scored = e.generate([ask + tokens], SamplingParams(max_tokens=1, prompt_logprobs=True))[0]
    model = [draw.logprob for draw in scored.prompt_scores[len(ask) - 1:]]
    assert len(model) == len(tokens)
    assert request.output_logprobs[:len(tokens)] == pytest.approx(model, abs=2e-3)
    assert min(request.output_logprobs) < -1.0  # held off the model's choice somewhere


def test_across_a_kv_transfer_the_answer_is_one_engines(loaded: LoadedModel,
                                                        ask: list[int]) -> None:
    """The first token drawn on a prefill engine, the rest on a decode engine that took the
    KV: the answer one engine gives, sampled and greedy."""
    for params in (guided(), guided(temperature=1.0, seed=7)):
        whole = engine(loaded).generate([ask], params)[0]
        moved = prefill_then_decode(engine(loaded, role=Role.PREFILL),
                                    engine(loaded, role=Role.DECODE), [ask], params)[0]
        assert moved.output_ids == whole.output_ids
        answer(engine(loaded), moved)


def test_a_resumed_request_goes_on_within_its_grammar(loaded: LoadedModel,
                                                      ask: list[int]) -> None:
    """A failover resumes a request with the tokens it streamed elsewhere: its new guide is
    fed them, and the answer goes on as it would have."""
    e = engine(loaded)
    whole = e.generate([ask], guided())[0].output_ids
    resumed = e.add_request("again", ask, guided(), output_ids=whole[:9])
    run(e)
    assert resumed.output_ids == whole


def test_a_token_outside_the_grammar_ends_the_answer(loaded: LoadedModel,
                                                     tokenizer: TextTokenizer,
                                                     ask: list[int]) -> None:
    e = engine(loaded)
    astray = e.add_request("astray", ask, guided(), output_ids=tokenizer.encode("Hello"))
    run(e)
    assert astray.finish_reason == "stop" and astray.output_ids[-1] in e.eos_ids
    assert len(astray.output_ids) == len(tokenizer.encode("Hello")) + 1


def test_max_tokens_cuts_the_json_as_openai_does(loaded: LoadedModel,
                                                 ask: list[int]) -> None:
    cut = engine(loaded).generate([ask], guided(max_tokens=5))[0]
    assert cut.finish_reason == "length" and len(cut.output_ids) == 5


def test_what_cannot_be_guided_is_rejected(loaded: LoadedModel, ask: list[int]) -> None:
    with pytest.raises(RequestRejected, match="does not compile"):
        engine(loaded).add_request("bad", ask, SamplingParams(grammar="start: ("))
    tiny = Engine(EngineConfig(model="tiny", device="cpu", kv_cache_bytes=1 << 20))
    with pytest.raises(RequestRejected, match="needs the model's tokenizer"):
        tiny.add_request("r", [1, 2, 3], guided())


def test_a_schema_json_cannot_hold_or_too_large_is_refused() -> None:
    with pytest.raises(ValueError, match="Invalid type"):
        json_grammar({"type": "foo"})
    with pytest.raises(ValueError, match="too large"):
        json_grammar({"enum": [f"value-{i}" for i in range(MAX_GRAMMAR_BYTES // 8)]})
    assert json_grammar({"type": "object", "if": {}})  # not strict: ignored
    with pytest.raises(ValueError, match="Unimplemented"):
        json_grammar({"type": "object", "if": {}}, strict=True)


@pytest.mark.parametrize("vocab", [96, 100, 130])  # the words' tokens, fewer, more
def test_the_compiled_mask_is_the_torch_one(vocab: int) -> None:
    kernels = cpu_kernels()
    assert kernels is not None
    g = torch.Generator().manual_seed(vocab)
    bits = torch.randint(-2**31, 2**31, (3, 3), dtype=torch.int64, generator=g).to(torch.int32)
    bits[0, 0], bits[1, 1] = -1, 0  # a word of every token, one of none
    logits = torch.randn(5, vocab, generator=g)
    rows = torch.tensor([4, 0, 2])
    ours, theirs = logits.clone(), logits.clone()
    kernels.mask_rows(ours, rows, bits)
    mask_rows(theirs, rows, bits)
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[[1, 3]], logits[[1, 3]])  # rows not named: untouched
    assert torch.equal(ours[4, :32], logits[4, :32])  # all allowed
    assert bool((ours[0, 32:64] == float("-inf")).all())  # none allowed
    kept = ours[2, :min(vocab, 96)] > float("-inf")
    expected = [(int(bits[2, t // 32]) >> (t % 32)) & 1 == 1 for t in range(min(vocab, 96))]
    assert kept.tolist() == expected
    if vocab > 96:  # past the words' tokens: none allowed
        assert bool((ours[:, 96:][[0, 2, 4]] == float("-inf")).all())


def test_rows_without_a_guide_are_left_alone(loaded: LoadedModel,
                                             tokenizer: TextTokenizer) -> None:
    vocab = loaded[0].config.vocab_size
    guides = Guides(tokenizer, vocab)
    logits = torch.randn(3, vocab)
    assert constrain(logits, [None, None, None], [[], [], []]) is logits
    masked = constrain(logits, [None, guides.guide(json_grammar(None)), None], [[], [], []])
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    allowed = masked[1] > float("-inf")
    # any JSON object begins with "{": every token it allows does
    assert 0 < int(allowed.sum()) < 10
    assert all(tokenizer.decode([t]).startswith("{") for t in allowed.nonzero().flatten())
