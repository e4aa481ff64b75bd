"""Prefix caching on the real model: a prompt that starts as an earlier one computes only
the rest, on a colocated engine and on a prefill instance whose KV a decode instance takes,
and answers as a pool without caching does."""

from __future__ import annotations

import pytest
import torch

from shared.engine.config import EngineConfig, Role
from shared.engine.engine import Engine, RequestOutput
from shared.engine.loader import LoadedModel
from shared.engine.request import SamplingParams
from shared.engine.tokenizer import TextTokenizer
from tests.engine.conftest import prefill_then_decode

pytestmark = pytest.mark.slow
PARAMS = SamplingParams(max_tokens=12, logprobs=True)
SYSTEM = ("You are a careful assistant for a small bakery. Answer in one short sentence, "
          "name the product, and never promise a delivery time.")
QUESTIONS = ["Do you sell rye bread?", "What is in the croissant?", "Are you open on Sunday?"]


def engine(loaded: LoadedModel, caching: bool, role: Role = Role.COLOCATED) -> Engine:
    return Engine(EngineConfig().with_scheduler(prefix_caching=caching, role=role), loaded)


def chats(tokenizer: TextTokenizer) -> list[list[int]]:
    return [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]))
        for q in QUESTIONS]


def one_by_one(e: Engine, prompts: list[list[int]], params: SamplingParams = PARAMS
               ) -> list[list[RequestOutput]]:
    outputs = []
    for i, ids in enumerate(prompts):
        e.add_request(f"q{i}", ids, params)
        mine: list[RequestOutput] = []
        while e.has_work():
            mine += e.step()
        outputs.append(mine)
    return outputs


def test_a_shared_system_prompt_is_computed_once_and_answers_stay_the_same(
        loaded: LoadedModel, tokenizer: TextTokenizer) -> None:
    prompts = chats(tokenizer)
    common = next(i for i, column in enumerate(zip(*prompts, strict=False))
                  if len(set(column)) > 1)  # the three share this many leading tokens
    assert common >= 32
    cached, plain = engine(loaded, True), engine(loaded, False)
    with_cache, without = one_by_one(cached, prompts), one_by_one(plain, prompts)
    found = [outs[0].cached_tokens for outs in with_cache]
    assert found[0] == 0 and all(common - 16 < n <= common for n in found[1:]), (found, common)
    assert n_hit(cached) == sum(found) and all(o[0].cached_tokens == 0 for o in without)
    for a, b in zip(with_cache, without, strict=True):
        assert [t for o in a for t in o.new_token_ids] == [t for o in b for t in o.new_token_ids]
        torch.testing.assert_close(torch.tensor([lp for o in a for lp in o.logprobs]),
                                   torch.tensor([lp for o in b for lp in o.logprobs]),
                                   rtol=0, atol=2e-3)
    assert cached.blocks.num_free == cached.blocks.num_blocks  # cached blocks count as free
    assert cached.blocks.num_cached > 0 and plain.blocks.num_cached == 0


def n_hit(e: Engine) -> int:
    return e.scheduler.prefix_hits


def test_a_prefix_is_found_on_both_sides_of_a_handoff_and_the_answers_stay_the_same(
        loaded: LoadedModel, tokenizer: TextTokenizer) -> None:
    prompts = chats(tokenizer)
    prefill, decode = engine(loaded, True, Role.PREFILL), engine(loaded, True, Role.DECODE)
    first = prefill_then_decode(prefill, decode, prompts[:1], PARAMS)
    hits = prefill.scheduler.prefix_hits
    assert hits == 0 and prefill.blocks.num_cached > 0  # released: its blocks kept
    assert decode.scheduler.prefix_hits == 0 and decode.blocks.num_cached > 0
    rest = prefill_then_decode(prefill, decode, prompts[1:], PARAMS)
    assert prefill.scheduler.prefix_hits >= 2 * 32
    # the decode side took the shared blocks it held and imported only those after them
    assert decode.scheduler.prefix_hits == prefill.scheduler.prefix_hits
    plain = engine(loaded, False)
    expected = one_by_one(plain, prompts)
    for request, outs in zip(first + rest, expected, strict=True):
        assert request.output_ids == [t for o in outs for t in o.new_token_ids]
    for e in (prefill, decode):
        assert e.blocks.num_free == e.blocks.num_blocks


def test_a_prompt_to_score_is_scored_whole_though_its_prefix_is_cached(
        loaded: LoadedModel, tokenizer: TextTokenizer) -> None:
    prompts = chats(tokenizer)
    e = engine(loaded, True)
    one_by_one(e, prompts[:1])
    scoring = SamplingParams(max_tokens=1, logprobs=True, prompt_logprobs=True)
    (outs,) = one_by_one(e, prompts[:1], scoring)
    assert outs[0].cached_tokens == 0
    assert len(outs[0].prompt_logprobs) == len(prompts[0]) - 1
