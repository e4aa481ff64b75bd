"""Quantized decode weights: a GGUF's blocks read as gguf-py reads them, the kernel equal to a
float matmul on the same weights, and the real model's predictions with int8 and int4 weights
measured against float32 (teacher-forced), also when an fp32 prefill engine hands its KV to an
int4 decode engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from gguf.quants import quantize as gguf_quantize

from shared.engine.config import EngineConfig, Role, weight_bits
from shared.engine.engine import Engine
from shared.engine.gguf_loader import resolve_gguf_path
from shared.engine.loader import LoadedModel
from shared.engine.model_runner import load_model
from shared.engine.quality import compare, next_token_logits
from shared.engine.quant import (
    QuantizedMatrix,
    QuantizedPanels,
    from_gguf_blocks,
    matmul,
    quantize,
    stack_rows,
)
from shared.engine.request import SamplingParams

from .conftest import NEW_TOKENS, prefill_then_decode

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def gguf_tensors() -> dict[str, object]:
    reader = GGUFReader(resolve_gguf_path("smollm2-135m"))
    return {t.name: t for t in reader.tensors}


@pytest.mark.parametrize("name", ["blk.0.ffn_down.weight", "token_embd.weight"])  # Q4_1, Q8_0
def test_gguf_blocks_are_read_as_gguf_py_dequantizes_them(gguf_tensors: dict[str, object],
                                                          name: str) -> None:
    tensor = gguf_tensors[name]
    kind = tensor.tensor_type.name  # type: ignore[attr-defined]
    blocks = from_gguf_blocks(tensor.data, kind)  # type: ignore[attr-defined]
    expected = dequantize(tensor.data, tensor.tensor_type)  # type: ignore[attr-defined]
    assert blocks.bits == (4 if kind == "Q4_1" else 8)
    assert blocks.shape == expected.shape
    torch.testing.assert_close(blocks.dequantize(), torch.from_numpy(expected), rtol=0,
                               atol=1e-6)


def test_q4_0_blocks_have_a_minimum_of_minus_eight_scales() -> None:
    w = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    data = gguf_quantize(w, GGMLQuantizationType.Q4_0)
    blocks = from_gguf_blocks(data, "Q4_0")
    torch.testing.assert_close(blocks.dequantize(), torch.from_numpy(
        dequantize(data, GGMLQuantizationType.Q4_0)), rtol=0, atol=1e-6)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantizing_rounds_each_weight_to_its_blocks_nearest_level(bits: int) -> None:
    w = torch.randn(40, 128, generator=torch.Generator().manual_seed(1))
    q = quantize(w, bits)
    step = q.scales.repeat_interleave(32, dim=1)
    error = (q.dequantize() - w).abs()
    assert (error <= step / 2 + 1e-6).all()
    assert error.max() > step.min() / 8  # and it did quantize
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize(torch.randn(4, 48), bits)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 13, 33, 49, 70])
def test_the_kernel_multiplies_as_the_dequantized_floats_do(bits: int, rows: int) -> None:
    """Rows around the kernel's tiles (AVX-512: 8, AVX2: 5, or 6 over blocks unpacked once
    from 6 rows a task) and past a task's rows (AVX-512: 64, AVX2: 48); 83 columns: five
    panels of 16 and a part one."""
    gen = torch.Generator().manual_seed(rows)
    q = quantize(torch.randn(83, 160, generator=gen), bits)
    panels = QuantizedPanels.pack(q)
    assert torch.equal(panels.dequantize(), q.dequantize())  # the layout loses nothing
    assert panels.shape == q.shape == (83, 160)
    x = torch.randn(rows, 160, generator=gen)
    torch.testing.assert_close(matmul(x, panels), x @ q.dequantize().T, rtol=1e-4, atol=1e-4)


def test_stacked_rows_keep_blocks_already_in_the_format() -> None:
    gen = torch.Generator().manual_seed(2)
    q8 = quantize(torch.randn(16, 64, generator=gen), 8)
    dense = torch.randn(8, 64, generator=gen)
    stacked = stack_rows([q8, dense], 8)
    assert torch.equal(stacked.qweight[:16], q8.qweight)  # not re-quantized
    torch.testing.assert_close(stacked.dequantize()[16:], quantize(dense, 8).dequantize())
    four = stack_rows([q8], 4)  # another format: through the floats
    assert isinstance(four, QuantizedMatrix) and four.bits == 4
    with pytest.raises(ValueError, match="unknown weight format"):
        weight_bits("int3")


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantized(request: pytest.FixtureRequest) -> tuple[str, LoadedModel]:
    return request.param, load_model(EngineConfig(weights=request.param))


def test_quantized_predictions_agree_with_float32(
        quantized: tuple[str, LoadedModel], loaded: LoadedModel,
        prompt_ids: list[list[int]], hf_tokens: list[list[int]]) -> None:
    """Teacher-forced over the 8 prompts' greedy continuations (up to 32 tokens; float32's
    equal HF's)."""
    name, (model, _) = quantized
    sequences = [ids + tokens for ids, tokens in zip(prompt_ids, hf_tokens, strict=True)]
    result = compare(model, loaded[0], sequences, [len(ids) for ids in prompt_ids])
    print(f"{name}: top-1 agreement {result.top1:.3f} over {result.positions} positions, "
          f"perplexity {result.perplexity:.3f} vs {result.reference_perplexity:.3f}")
    assert result.positions == sum(len(tokens) for tokens in hf_tokens) > 200
    assert result.top1 >= 0.9
    assert result.perplexity_ratio < 1.1
    assert model.weight_bytes() < loaded[0].weight_bytes() / 3


def test_an_int4_decode_engine_continues_kv_prefilled_in_float32(
        loaded: LoadedModel, prompt_ids: list[list[int]], hf_tokens: list[list[int]]) -> None:
    """The disaggregated round trip with a full-precision prefill and an int4 decode engine:
    the KV is float32 on both sides and moves unchanged."""
    int4 = load_model(EngineConfig(weights="int4"))
    assert isinstance(int4[0].layers[0].qkv, QuantizedPanels)
    prefill = Engine(EngineConfig(kv_cache_bytes=32 << 20).with_scheduler(role=Role.PREFILL),
                     loaded)
    decode = Engine(EngineConfig(kv_cache_bytes=32 << 20, weights="int4").with_scheduler(
        role=Role.DECODE), int4)
    moved = prefill_then_decode(prefill, decode, prompt_ids, GREEDY)
    compared = sum(len(tokens) for tokens in hf_tokens)  # HF's stop at EOS
    same = sum(a == b for r, tokens in zip(moved, hf_tokens, strict=True)
               for a, b in zip(r.output_ids, tokens, strict=False))
    print(f"fp32 prefill -> int4 decode: {same} of {compared} greedy tokens as fp32's")
    assert same >= 0.9 * compared
    assert decode.blocks.num_free == decode.blocks.num_blocks


def test_a_pairs_logits_are_the_prefill_models_then_the_other_models_over_its_kv() -> None:
    """`prefilled_by`: the prompt's rows are the prefilling model's own, to the bit; the
    rest are the continuing model's over that KV, near its own over its own KV but not it."""
    fp32, bf16 = (load_model(EngineConfig(model="tiny", dtype=d))[0]
                  for d in ("float32", "bfloat16"))
    ids = list(range(3, 40))
    pair = next_token_logits(fp32, ids, prefilled_by=bf16, prompt=20)
    alone = next_token_logits(fp32, ids)
    assert torch.equal(pair[:20], next_token_logits(bf16, ids[:20]))
    assert torch.allclose(pair[20:], alone[20:], atol=0.05) and not torch.equal(pair[20:],
                                                                             alone[20:])
    with pytest.raises(ValueError, match="needs one at least"):
        next_token_logits(fp32, ids, prefilled_by=bf16)


@pytest.mark.parametrize("decode_weights", ["auto", "int4"])
def test_a_bfloat16_prefill_engine_hands_float32_kv_to_any_decode_engine(
        decode_weights: str, loaded: LoadedModel, prompt_ids: list[list[int]],
        hf_tokens: list[list[int]]) -> None:
    """A prefill engine computing in bfloat16 (twice the matmul width where the CPU has
    bfloat16 dot products) keeps its KV in float32, the pool every CPU engine shares: its
    blocks are float32's to bfloat16's rounding; a float32 or int4 decode engine continuing
    them predicts as float32 does (teacher-forced: the pair as it serves, the bfloat16 model
    prefilling each prompt), and the engines' round trip decodes every request."""
    bf16 = load_model(EngineConfig(dtype="bfloat16"))
    prefill = Engine(EngineConfig(dtype="bfloat16", kv_cache_bytes=32 << 20).with_scheduler(
        role=Role.PREFILL), bf16)
    exact = Engine(EngineConfig(kv_cache_bytes=32 << 20).with_scheduler(role=Role.PREFILL),
                   loaded)
    assert bf16[0].dtype == torch.bfloat16 and prefill.runner.kv.data.dtype == torch.float32
    for engine in (prefill, exact):
        engine.add_request("r", prompt_ids[1], GREEDY)
        engine.step()
    ours, theirs = prefill.export_kv("r"), exact.export_kv("r")
    off = ((ours - theirs).norm() / theirs.norm()).item()
    print(f"bfloat16 prefill's KV off float32's by {off:.2e}")
    assert ours.dtype == torch.float32 and 1e-4 < off < 5e-2  # bfloat16's rounding, no more
    for engine in (prefill, exact):
        engine.release("r")
    decode_model = loaded if decode_weights == "auto" else load_model(
        EngineConfig(weights=decode_weights))
    sequences = [ids + tokens for ids, tokens in zip(prompt_ids, hf_tokens, strict=True)]
    pair = compare(decode_model[0], loaded[0], sequences, [len(ids) for ids in prompt_ids],
                   prefilled_by=bf16[0])
    print(f"bfloat16 prefill -> {decode_weights} decode: top-1 agreement {pair.top1:.3f} over "
          f"{pair.positions} positions, perplexity {pair.perplexity:.3f} vs "
          f"{pair.reference_perplexity:.3f}")
    assert pair.positions == sum(len(tokens) for tokens in hf_tokens) > 200
    assert pair.top1 >= 0.9 and pair.perplexity_ratio < 1.1
    decode = Engine(EngineConfig(kv_cache_bytes=32 << 20, weights=decode_weights).with_scheduler(
        role=Role.DECODE), decode_model)
    moved = prefill_then_decode(prefill, decode, prompt_ids, GREEDY)
    assert [len(r.output_ids) for r in moved] == [NEW_TOKENS] * len(prompt_ids)
    assert decode.blocks.num_free == decode.blocks.num_blocks


def test_quantized_weights_are_refused_where_the_kernel_cannot_run() -> None:
    with pytest.raises(ValueError, match="CPU in float32"):
        load_model(EngineConfig(model="tiny", weights="int4", dtype="bfloat16", device="cpu"))
