"""A decode step's layers in one compiled call (kernels/decode_layers.cpp) against the same
layers one operation at a time: the real SmolLM2-135M in every weight format, requests that
join, leave and grow past their blocks while others decode."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from shared.engine.attention import (
    AttentionMetadata,
    DecodeGroup,
    PrefillSegment,
    gather_decode_attention,
    paged_decode_attention,
)
from shared.engine.config import LLAMA_SHAPES, EngineConfig
from shared.engine.engine import Engine
from shared.engine.kernels import cpu_kernels
from shared.engine.model import LlamaModel
from shared.engine.request import SamplingParams

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="needs a C++ compiler")


class Counting:
    """The compiled kernels, counting the fused calls."""

    def __init__(self, kernels: Any) -> None:
        self.kernels, self.fused = kernels, 0

    def __getattr__(self, name: str) -> Any:
        if name == "decode_layers":
            self.fused += 1
        return getattr(self.kernels, name)


def run(engine: Engine, fused: bool) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
    """Greedy tokens and their logprobs of prompts that arrive, leave and grow while others
    decode (a prompt of 40 tokens crosses two 16-token blocks within its first steps)."""
    engine.runner.model.fused_decode = fused
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    params = SamplingParams(max_tokens=30, ignore_eos=True, logprobs=True)
    arrivals = {0: [(5, "a"), (40, "b")], 6: [(120, "c")], 12: [(17, "d")]}
    step = 0
    while step == 0 or engine.has_work():
        for length, name in arrivals.get(step, []):
            engine.add_request(name, [300 + 11 * step + i for i in range(length)], params)
        if step == 9:
            engine.abort("b")  # its blocks go back to the pool, for "d" to take
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            logprobs.setdefault(out.request_id, []).extend(out.logprobs)
        step += 1
    return tokens, logprobs


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["auto", "int8", "int4"])
def test_fused_decode_layers_compute_what_the_layers_compute_one_by_one(weights: str) -> None:
    engine = Engine(EngineConfig(weights=weights, threads=2, kv_cache_bytes=64 << 20))
    model = engine.runner.model
    counting = Counting(model.ops)
    model.ops = counting
    try:
        apart, apart_logprobs = run(engine, fused=False)
        assert counting.fused == 0
        together, together_logprobs = run(engine, fused=True)
    finally:
        engine.close()
    assert counting.fused >= 30  # the decode-only steps of the second run (not its prefills)
    assert together == apart
    assert set(together) == {"a", "b", "c", "d"} and len(together["c"]) == 30
    for name, expected in apart_logprobs.items():
        torch.testing.assert_close(torch.tensor(together_logprobs[name]),
                                   torch.tensor(expected), rtol=0, atol=1e-5)


def test_fused_decode_layers_refuse_a_slot_outside_the_pool() -> None:
    kernels = cpu_kernels()
    assert kernels is not None
    layers, hidden, heads, kv_heads, dim, block = 1, 32, 2, 1, 16, 4
    pool = torch.zeros(layers, 2, 3, block, kv_heads, dim)
    width = 48  # the float panels' width on AVX-512; the check comes first anyway
    panels = torch.zeros(1, hidden, width)
    norms = [torch.ones(hidden), torch.ones(hidden)]
    empty = torch.empty(0)
    tensors = norms + [panels, empty, empty] * 4
    shapes = [32, (heads + 2 * kv_heads) * dim, 32, hidden, 32, 2 * hidden, 32, hidden]
    angles = torch.zeros(64, dim)
    one = torch.tensor([0])
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernels.decode_layers(torch.ones(1, hidden), tensors, shapes, pool, one,
                              torch.tensor([3 * block]), torch.tensor([[0]]), torch.tensor([1]),
                              angles.cos(), angles.sin(), heads, 1e-5, dim ** -0.5)
    with pytest.raises(RuntimeError, match="block outside the pool"):
        kernels.decode_layers(torch.ones(1, hidden), tensors, shapes, pool, one,
                              one, torch.tensor([[7]]), torch.tensor([1]),
                              angles.cos(), angles.sin(), heads, 1e-5, dim ** -0.5)


def test_only_a_decode_step_on_a_rank_of_whole_heads_runs_fused() -> None:
    tiny = LLAMA_SHAPES["tiny"]
    cpu = torch.device("cpu")
    model = LlamaModel.random(tiny, 0, cpu, torch.float32)
    model.decode_attention = paged_decode_attention
    group = DecodeGroup.of(0, torch.zeros(2, 1, dtype=torch.long), torch.tensor([3, 5]), 16)
    decoding = AttentionMetadata(torch.tensor([2, 20]), [], group)
    assert model.fused_layers is not None and model._fuses(decoding)
    prompt = PrefillSegment(0, 4, 0, torch.zeros(1, dtype=torch.long))
    assert not model._fuses(AttentionMetadata(torch.arange(6), [prompt],
                                              DecodeGroup.of(4, group.block_tables,
                                                             group.context_lens, 16)))
    model.all_reduce = lambda t: None  # tp > 1: the all-reduces come between the layers' halves
    assert not model._fuses(decoding)
    model.all_reduce = None
    model.decode_attention = gather_decode_attention
    assert not model._fuses(decoding)
    for shape in ({"qkv_bias": True}, {"qk_norm": True}):
        other = LlamaModel.random(dataclasses.replace(tiny, **shape), 0, cpu, torch.float32)
        assert other.fused_layers is None
    assert LlamaModel.random(tiny, 0, cpu, torch.float32, weight_bits=4).fused_layers is not None


@pytest.mark.parametrize("weights", ["auto", "int4"])
def test_a_batch_wider_than_a_threads_rows_runs_fused_as_one_by_one(weights: str) -> None:
    """20 requests decoding together on a random-weight shape: the fused call's row-wise
    phases (norms, RoPE and the KV write, SiLU, residuals) split over both threads, 16 rows
    a thread, and its tokens and logprobs are still the per-operation path's."""
    engine = Engine(EngineConfig(model="tiny", weights=weights, threads=2,
                                 kv_cache_bytes=16 << 20).with_scheduler(max_running=32))
    counting = Counting(engine.runner.model.ops)
    engine.runner.model.ops = counting
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=True)
    got = []
    try:
        for fused in (False, True):
            engine.runner.model.fused_decode = fused
            for i in range(20):
                engine.add_request(f"{i}", [3 + 7 * i + j for j in range(5 + 3 * i)], params)
            outputs: dict[str, tuple[list[int], list[float]]] = {}
            while engine.has_work():
                for out in engine.step():
                    tokens, logprobs = outputs.setdefault(out.request_id, ([], []))
                    tokens.extend(out.new_token_ids)
                    logprobs.extend(out.logprobs)
            got.append(outputs)
    finally:
        engine.close()
    assert counting.fused >= 7  # every decode step of the second run
    assert all(len(tokens) == 8 for tokens, _ in got[1].values()) and len(got[1]) == 20
    assert got[0] == got[1]
