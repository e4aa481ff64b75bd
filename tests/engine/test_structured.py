"""Answers held to a JSON schema (structured.py): every token drawn within the grammar, on one
engine, across a KV transfer and after a failover's resume; the logprobs the model's own."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema_rs
import pytest
import torch

from services.gateway.tool_calls import MOST_CALLS, forced_grammar, parse
from shared.engine.config import EngineConfig, Role
from shared.engine.engine import Engine, RequestRejected
from shared.engine.kernels import cpu_kernels
from shared.engine.loader import LoadedModel
from shared.engine.request import Request, SamplingParams
from shared.engine.sampler import constrain, mask_rows
from shared.engine.structured import (
    MAX_GRAMMAR_BYTES,
    Guides,
    choice_grammar,
    json_grammar,
    regex_grammar,
    text_grammar,
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


def test_a_regex_a_choice_and_a_grammar_hold_the_whole_answer(
        loaded: LoadedModel, tokenizer: TextTokenizer, ask: list[int]) -> None:
    """vLLM's other formats: the whole text matches the regex, is one of the choices, is a
    sentence of the grammar (llama.cpp's GBNF, and Lark's), sampled as well as greedy."""
    e = engine(loaded)
    held = {"regex": (regex_grammar(r"[0-9]{3}-[a-z]{2,4}"),
                      lambda text: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text)),
            "choice": (choice_grammar(["Paris", "Rome", "the moon"]),
                       lambda text: text in ("Paris", "Rome", "the moon")),
            "gbnf": (text_grammar('root ::= "(" [a-z]+ ("," [a-z]+)* ")"'),
                     lambda text: re.fullmatch(r"\([a-z]+(,[a-z]+)*\)", text)),
            "lark": (text_grammar('start: "yes" | "no" | NUMBER\nNUMBER: /[1-9][0-9]?/'),
                     lambda text: re.fullmatch(r"yes|no|[1-9][0-9]?", text))}
    requests = {(name, seed): e.add_request(f"{name}{seed}", ask, SamplingParams(
        max_tokens=24, grammar=grammar, temperature=1.0 if seed else 0.0, seed=seed))
        for name, (grammar, _) in held.items() for seed in range(3)}
    run(e)
    for (name, _), request in requests.items():
        text = tokenizer.decode(request.output_ids)
        assert request.finish_reason == "stop" and held[name][1](text), (name, text)


WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city", "unit"], "additionalProperties": False,
    "properties": {"city": {"type": "string", "maxLength": 30},
                   "unit": {"enum": ["celsius", "fahrenheit"]}}}}
# no "type" (an object all the same), a $ref inside, annotations, a property named "title"
TIME = {"name": "get_time", "description": "The time in a zone.", "parameters": {
    "$defs": {"Zone": {"enum": ["Europe/Paris", "UTC"], "description": "An IANA zone."}},
    "required": ["zone"], "properties": {"zone": {"$ref": "#/$defs/Zone"},
                                         "title": {"type": "boolean", "title": "Titled"}}}}


@pytest.mark.parametrize("form", ["hermes", "llama3_json"])
def test_a_required_call_is_a_call_of_an_offered_function(
        loaded: LoadedModel, tokenizer: TextTokenizer, form: str) -> None:
    """tool_choice that requires a call, held to the model's call format: the answer parses
    as calls (tool_calls.parse, as the gateway reads it) of the function named, or of one of
    those offered, each with arguments valid against its parameters; one call, or several
    where parallel calls are allowed. Any model makes one: this one has no tool template."""
    e = engine(loaded)
    ask = tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]))
    held = {"named": (forced_grammar([WEATHER], form), {"get_weather"}, False),
            "required": (forced_grammar([WEATHER, TIME], form), {"get_weather", "get_time"},
                         False),
            "parallel": (forced_grammar([WEATHER, TIME], form, MOST_CALLS),
                         {"get_weather", "get_time"}, True)}
    requests = {(name, seed): e.add_request(f"{name}{seed}", ask, SamplingParams(
        max_tokens=400, grammar=grammar, temperature=1.0 if seed else 0.0, seed=seed))
        for name, (grammar, _, _) in held.items() for seed in range(3)}
    run(e)
    parameters = {f["name"]: f["parameters"] for f in (WEATHER, TIME)}
    for (name, _), request in requests.items():
        text = tokenizer.decode(request.output_ids)
        assert request.finish_reason == "stop", (name, text)
        answer = parse(text, parallel=held[name][2], form=form)
        assert answer.content is None and answer.calls, (name, text)
        assert len(answer.calls) <= (MOST_CALLS if held[name][2] else 1)
        for call in answer.calls:
            assert call["function"]["name"] in held[name][1]
            jsonschema_rs.validate(parameters[call["function"]["name"]],
                                   json.loads(call["function"]["arguments"]))


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


def test_a_token_outside_the_grammar_fails_the_request(loaded: LoadedModel,
                                                       tokenizer: TextTokenizer,
                                                       ask: list[int]) -> None:
    """A resumed request whose streamed tokens its grammar refuses (none drawn within it
    are) ends at once, with an error that says so."""
    e = engine(loaded)
    astray = e.add_request("astray", ask, guided(), output_ids=tokenizer.encode("Hello"))
    outputs = []
    while e.has_work():
        outputs += e.step()
    assert astray.output_ids[-1] in e.eos_ids
    assert len(astray.output_ids) == len(tokenizer.encode("Hello")) + 1
    assert [out.refused for out in outputs] == [True]
    assert "could not be held to its format after 1 tokens" in (outputs[0].error or "")


def test_a_grammar_is_compiled_once_and_each_request_goes_its_own_way(
        loaded: LoadedModel, tokenizer: TextTokenizer) -> None:
    """The second request of a format copies the first's compiled matcher (a client's
    schema sent again, n choices), and the copies advance apart; a failure is kept too."""
    guides = Guides(tokenizer, loaded[0].config.vocab_size)
    grammar = choice_grammar(["yes", "no"])
    assert guides.compiled(grammar) is guides.compiled(grammar)
    first, second = guides.guide(grammar), guides.guide(grammar)
    assert first.matcher is not second.matcher
    first.feed(tokenizer.encode("yes"))
    assert first.matcher.is_stopped() and not second.matcher.is_stopped()
    bad = json_grammar({"$ref": "#"})
    for _ in range(2):
        with pytest.raises(ValueError, match="no text satisfies it"):
            guides.compiled(bad)
    small = Guides(tokenizer, loaded[0].config.vocab_size, cached=1)
    small.compiled(grammar)
    small.compiled(json_grammar(None))
    assert list(small._compiled) == [json_grammar(None)]  # the older one gone


def test_max_tokens_cuts_the_json_as_openai_does(loaded: LoadedModel,
                                                 ask: list[int]) -> None:
    cut = engine(loaded).generate([ask], guided(max_tokens=5))[0]
    assert cut.finish_reason == "length" and len(cut.output_ids) == 5


def test_what_cannot_be_guided_is_rejected(loaded: LoadedModel, ask: list[int]) -> None:
    with pytest.raises(RequestRejected, match=r"cannot be held to its format: .*Expected"):
        engine(loaded).add_request("bad", ask, SamplingParams(grammar="start: ("))
    tiny = Engine(EngineConfig(model="tiny", device="cpu", kv_cache_bytes=1 << 20))
    with pytest.raises(RequestRejected, match="needs the model's tokenizer"):
        tiny.add_request("r", [1, 2, 3], guided())


def test_what_no_answer_can_be_held_to_is_refused(loaded: LoadedModel,
                                                  tokenizer: TextTokenizer) -> None:
    """The builders refuse what is no format at all; `Guides.check` (the gateway's) what
    does not compile, or lets no answer begin, within LIMITS."""
    guides = Guides(tokenizer, loaded[0].config.vocab_size)
    with pytest.raises(ValueError, match="Invalid type"):
        guides.check(json_grammar({"type": "foo"}))
    with pytest.raises(ValueError, match="unclosed group"):
        guides.check(regex_grammar("("))
    with pytest.raises(ValueError, match="no text satisfies it"):
        guides.check(json_grammar({"$ref": "#"}))
    guides.check(json_grammar({"type": "object", "if": {}}))  # not strict: ignored
    with pytest.raises(ValueError, match="Unimplemented"):
        guides.check(json_grammar({"type": "object", "if": {}}, strict=True))
    with pytest.raises(ValueError, match="key must be a string"):
        json_grammar("{not json")
    with pytest.raises(ValueError, match="one or more non-empty"):
        choice_grammar(["a", ""])
    with pytest.raises(ValueError, match="GBNF"):
        text_grammar("root ::= (")
    with pytest.raises(ValueError, match="the grammar is too large"):
        text_grammar("start: " + "|".join(f'"{i}"' for i in range(MAX_GRAMMAR_BYTES // 4)))
    with pytest.raises(ValueError, match="the schema is too large"):
        json_grammar({"enum": [f"value-{i}" for i in range(MAX_GRAMMAR_BYTES // 8)]})


def test_a_grammar_that_outgrows_its_limits_fails_its_request_alone(
        loaded: LoadedModel, ask: list[int]) -> None:
    """A pattern whose first mask fits the limits and whose next does not (llguidance alone
    would spend 0.16 s a token on it): its request ends at once with an error that is the
    request's own (refused: a 400), and the request beside it in the same steps goes on."""
    e = engine(loaded)
    heavy = SamplingParams(max_tokens=20, grammar=json_grammar(
        {"type": "string", "pattern": "^a{1000}{1000}$"}))
    e.add_request("heavy", ask, heavy)
    beside = e.add_request("beside", ask, guided())
    outputs = []
    while e.has_work():
        outputs += e.step()
    failed = [out for out in outputs if out.request_id == "heavy" and out.error]
    assert len(failed) == 1 and failed[0].refused and failed[0].finished
    assert "could not be held to its format" in (failed[0].error or "")
    assert not any(out.error for out in outputs if out.request_id == "beside")
    answer(e, beside)
    assert e.blocks.num_free == e.blocks.num_blocks  # nothing held after


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
