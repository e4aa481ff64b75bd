"""Greedy tokens of the engine equal HF transformers' on the same weights, however requests
are batched: one at a time, all at once, joining mid-way, chunked, preempted, or moved
between two engines."""

from __future__ import annotations

import pytest

from shared.engine.config import EngineConfig, Role
from shared.engine.engine import Engine, RequestOutput
from shared.engine.kv_cache import block_bytes
from shared.engine.loader import LoadedModel
from shared.engine.request import Request, SamplingParams
from tests.engine.conftest import NEW_TOKENS

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_tokens=NEW_TOKENS)


def engine(loaded: LoadedModel, **scheduler: object) -> Engine:
    return Engine(EngineConfig().with_scheduler(**scheduler), loaded)


def run(e: Engine) -> None:
    while e.has_work():
        e.step()


def test_hf_reference_really_generated(hf_tokens: list[list[int]]) -> None:
    assert len(hf_tokens) == 8 and all(len(t) >= 8 for t in hf_tokens)
    assert len({tuple(t) for t in hf_tokens}) == 8


def test_the_cpu_runs_its_own_float_matmul_with_one_copy_of_a_tied_embedding(
        loaded: LoadedModel) -> None:
    """float32 on the CPU: every layer's matrices and the LM head in panels (every greedy
    token in this file comes through them), the tied embedding read from the head's panels,
    not kept twice."""
    from shared.engine.panels import PanelMatrix

    model, _ = loaded
    assert isinstance(model.lm_head, PanelMatrix) and model.embed is model.lm_head
    assert all(isinstance(m, PanelMatrix) for layer in model.layers
               for m in (layer.qkv, layer.o, layer.gate_up, layer.down))


def test_one_at_a_time_matches_hf(loaded: LoadedModel, prompt_ids: list[list[int]],
                                  hf_tokens: list[list[int]]) -> None:
    e = engine(loaded)
    for ids, expected in zip(prompt_ids, hf_tokens, strict=True):
        (request,) = e.generate([ids], GREEDY)
        assert request.output_ids == expected


def test_batched_matches_hf(loaded: LoadedModel, prompt_ids: list[list[int]],
                            hf_tokens: list[list[int]]) -> None:
    e = engine(loaded)
    requests = e.generate(prompt_ids, GREEDY)
    assert [r.output_ids for r in requests] == hf_tokens
    assert e.blocks.num_free == e.blocks.num_blocks


def test_continuous_batching_with_requests_joining_midway(
        loaded: LoadedModel, prompt_ids: list[list[int]], hf_tokens: list[list[int]]) -> None:
    e = engine(loaded)
    first = [e.add_request(f"a{i}", ids, GREEDY) for i, ids in enumerate(prompt_ids[:4])]
    for _ in range(6):
        e.step()
    assert all(0 < len(r.output_ids) < NEW_TOKENS for r in first)  # really mid-way
    later = [e.add_request(f"b{i}", ids, GREEDY) for i, ids in enumerate(prompt_ids[4:])]
    run(e)
    assert [r.output_ids for r in first + later] == hf_tokens


@pytest.mark.parametrize("chunked", [False, True])
def test_colocated_modes_match_hf(loaded: LoadedModel, prompt_ids: list[list[int]],
                                  hf_tokens: list[list[int]], chunked: bool) -> None:
    # a budget of 8 tokens forces every prompt through several chunks
    e = engine(loaded, chunked_prefill=chunked, max_batch_tokens=8 if chunked else 64)
    requests = [e.add_request(f"c{i}", ids, GREEDY) for i, ids in enumerate(prompt_ids[:4])]
    e.step()
    requests += [e.add_request(f"d{i}", ids, GREEDY) for i, ids in enumerate(prompt_ids[4:])]
    run(e)
    assert [r.output_ids for r in requests] == hf_tokens


def test_preemption_under_a_tiny_pool_loses_nothing(
        loaded: LoadedModel, prompt_ids: list[list[int]], hf_tokens: list[list[int]]) -> None:
    # 8 requests of up to ~50 tokens in 4-token blocks need far more than 24 blocks at once
    model = loaded[0]
    budget = 24 * block_bytes(model.config, 4, model.dtype)
    config = EngineConfig(kv_cache_bytes=budget).with_scheduler(block_size=4, watermark_blocks=0)
    e = Engine(config, loaded)
    assert e.blocks.num_blocks == 24
    requests = [e.add_request(f"p{i}", ids, GREEDY) for i, ids in enumerate(prompt_ids)]
    run(e)
    assert sum(r.num_preemptions for r in requests) > 0
    assert [r.output_ids for r in requests] == hf_tokens
    assert e.blocks.num_free == 24


def test_disaggregated_round_trip(loaded: LoadedModel, prompt_ids: list[list[int]],
                                  hf_tokens: list[list[int]]) -> None:
    prefill = engine(loaded, role=Role.PREFILL)
    decode = engine(loaded, role=Role.DECODE)
    taken = decode.allocate(5 * 16)  # occupy decode's first blocks so the ids differ
    assert taken is not None
    for i, ids in enumerate(prompt_ids):
        prefill.add_request(f"r{i}", ids, GREEDY)
    outputs = prefill.step()
    assert all(o.parked for o in outputs) and len(outputs) == len(prompt_ids)
    moved = []
    for i, ids in enumerate(prompt_ids):
        parked = prefill.scheduler.parked[f"r{i}"]
        buffer = prefill.export_kv(parked.request_id)
        blocks = decode.allocate(len(ids))
        assert blocks is not None and not set(blocks) & set(parked.block_table)
        request = Request(parked.request_id, ids, GREEDY, eos_ids=decode.eos_ids,
                          output_ids=list(parked.output_ids))
        decode.admit_imported(request, blocks, buffer)
        assert prefill.release(parked.request_id)
        moved.append(request)
    assert prefill.blocks.num_free == prefill.blocks.num_blocks
    run(decode)
    assert [r.output_ids for r in moved] == hf_tokens
    decode.free(taken)
    assert decode.blocks.num_free == decode.blocks.num_blocks


def test_stop_strings_and_text_stream(loaded: LoadedModel, prompt_ids: list[list[int]]) -> None:
    e = engine(loaded)
    e.add_request("s", prompt_ids[0], SamplingParams(max_tokens=20))
    full = ""
    while e.has_work():
        full += "".join(o.new_text for o in e.step())
    assert "Paris" in full
    e.add_request("t", prompt_ids[0], SamplingParams(max_tokens=20, stop=("ari",)))
    outputs = []
    while e.has_work():
        outputs += e.step()
    text = "".join(o.new_text for o in outputs)
    assert outputs[-1].finish_reason == "stop"
    assert text == full[: full.index("ari")]
    # the last token allowed completes the stop string: it stopped there, its text cut
    e.add_request("u", prompt_ids[0], SamplingParams(max_tokens=len(outputs), stop=("ari",)))
    last = []
    while e.has_work():
        last += e.step()
    assert last[-1].finish_reason == "stop" and "".join(o.new_text for o in last) == text
    assert e.blocks.num_free == e.blocks.num_blocks


def test_seeded_sampling_is_reproducible_across_engines(
        loaded: LoadedModel, prompt_ids: list[list[int]]) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=7, logprobs=True)
    a = engine(loaded).generate(prompt_ids[:2], params)
    b = engine(loaded).generate(prompt_ids[:2], params)
    assert [r.output_ids for r in a] == [r.output_ids for r in b]
    assert all(len(r.output_logprobs) == len(r.output_ids) for r in a)
    assert all(lp <= 0 for r in a for lp in r.output_logprobs)


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(max_tokens=NEW_TOKENS,
                                                           temperature=0.9, seed=11)],
                         ids=["greedy", "seeded"])
@pytest.mark.parametrize("held", [True, False], ids=["kv-held", "re-prefill"])
def test_a_request_resumed_mid_stream_continues_as_if_uninterrupted(
        loaded: LoadedModel, prompt_ids: list[list[int]], params: SamplingParams,
        held: bool) -> None:
    """Failover: a request that streamed k tokens from a decode instance that died goes on
    elsewhere, either from the prompt's KV the prefill instance still holds (the k tokens
    replayed as one chunk on the new decode engine) or prefilled again with its k tokens.
    The tokens and the text equal an uninterrupted run's."""
    whole = engine(loaded)
    requests = [whole.add_request(f"r{i}", ids, params) for i, ids in enumerate(prompt_ids)]
    pieces: list[RequestOutput] = []
    while whole.has_work():
        pieces += whole.step()
    tokens = {r.request_id: r.output_ids for r in requests}
    whole_text = {r: "".join(o.new_text for o in pieces if o.request_id == r) for r in tokens}
    prefill = engine(loaded, role=Role.PREFILL)
    decode = engine(loaded, role=Role.DECODE)
    streamed: dict[str, str] = {}
    # tokens streamed before the failure (fewer than the whole, which ends with the finish)
    cut = {f"r{i}": min(1 + i * 3, len(tokens[f"r{i}"]) - 1) for i in range(len(prompt_ids))}
    assert sum(cut.values()) > 2 * len(cut)
    for i, ids in enumerate(prompt_ids):
        request_id, k = f"r{i}", cut[f"r{i}"]
        done = tokens[request_id][:k]
        streamed[request_id] = "".join(o.new_text for o in pieces
                                       if o.request_id == request_id and o.index < k)
        prefill.add_request(request_id, ids, params, output_ids=None if held else done)
    outputs = {o.request_id: o for o in prefill.step()}
    for i, ids in enumerate(prompt_ids):
        request_id, k = f"r{i}", cut[f"r{i}"]
        if outputs[request_id].finished:  # prefilled again, it ended at its next token
            streamed[request_id] += outputs[request_id].new_text
            continue
        parked = prefill.scheduler.parked[request_id]
        if held:
            outputs_so_far = tokens[request_id][:k]
        else:  # the prefill engine sampled the next token at its own index
            assert outputs[request_id].index == k
            assert parked.output_ids == tokens[request_id][:k + 1]
            streamed[request_id] += outputs[request_id].new_text
            outputs_so_far = parked.output_ids
        blocks = decode.allocate(parked.num_computed)
        assert blocks is not None
        request = Request(request_id, ids, params, eos_ids=decode.eos_ids,
                          output_ids=list(outputs_so_far))
        decode.admit_imported(request, blocks, prefill.export_kv(request_id),
                              computed=parked.num_computed)
        prefill.release(request_id)
    while decode.has_work():
        for out in decode.step():
            streamed[out.request_id] += out.new_text
    assert streamed == whole_text
    assert decode.blocks.num_free == decode.blocks.num_blocks
    assert prefill.blocks.num_free == prefill.blocks.num_blocks


@pytest.mark.parametrize("chunked", [False, True])
def test_prompt_logprobs_are_what_sampling_saw(loaded: LoadedModel, prompt_ids: list[list[int]],
                                               chunked: bool) -> None:
    """A prompt's tokens scored in its prefill (echo with logprobs) have the logprobs they
    had when they were generated: a greedy continuation, fed back as a prompt, scores its
    tokens as sampling did; whole or in chunks of 8, each prompt token scored once."""
    e = engine(loaded)
    asked = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=True)
    generated = e.generate(prompt_ids, asked)
    scoring = engine(loaded, chunked_prefill=chunked, max_batch_tokens=8 if chunked else 2048)
    fed_back = [p + r.output_ids for p, r in zip(prompt_ids, generated, strict=True)]
    scored = scoring.generate(fed_back, SamplingParams(
        max_tokens=1, logprobs=True, top_logprobs=2, prompt_logprobs=True))
    for r, ids, first in zip(scored, fed_back, generated, strict=True):
        assert [d.token for d in r.prompt_scores] == ids[1:]
        tail = r.prompt_scores[-len(first.output_ids):]
        assert [d.logprob for d in tail] == pytest.approx(first.output_logprobs, abs=2e-4)
        assert all(d.top[0][0] == d.token for d in tail)  # greedy: each was the likeliest
        assert all(len(d.top) == 2 for d in r.prompt_scores)
