"""The engine on every device this machine has (the CPU; a GPU where there is one) scores the
tokens it generates as HF transformers does on the same weights, on that device: prefill,
paged decode, chunks and the KV moved between a prefill and a decode engine. Each generated
token's logprob is compared, not only greedy tokens, so a decode step that attends to the
wrong KV cannot pass by sampling what the prompt's last token alone suggests.

Self-contained (no conftest fixture, no GGUF): `pytest --noconftest` runs it on a GPU
machine that has none of the model files."""

from __future__ import annotations

import pytest
import torch

from shared.engine.config import EngineConfig, Role
from shared.engine.engine import Engine
from shared.engine.hf_reference import load_hf_reference
from shared.engine.request import Request, SamplingParams

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
SHAPE = "tiny"
# sampled (seeded) so the tokens vary, each with its logprob under the engine's logits
PARAMS = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True, logprobs=True)
# the largest |engine logprob - HF logprob| allowed (the CPU: 5e-7 and 2e-3; a decode step on
# KV scaled by half is off by 0.07)
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.03}


def prompts(n: int = 6) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, 500, (int(length),), generator=gen).tolist()
            for length in torch.randint(3, 70, (n,), generator=gen)]


def run(e: Engine) -> None:
    while e.has_work():
        e.step()


def hf_logprobs(hf: object, prompt: list[int], output: list[int]) -> torch.Tensor:
    """HF's logprob of each output token, teacher-forced on the prompt and the outputs."""
    device = next(hf.parameters()).device  # type: ignore[attr-defined]
    ids = torch.tensor([prompt + output], device=device)
    with torch.inference_mode():
        logits = hf(ids).logits[0, len(prompt) - 1:-1].float()  # type: ignore[operator]
    return logits.log_softmax(-1).gather(1, torch.tensor(output, device=device)[:, None])[:, 0]


def disaggregated(config: EngineConfig, ids: list[list[int]]) -> list[Request]:
    """Prefill on one engine, the KV exported and imported into another, decoded there."""
    prefill = Engine(config.with_scheduler(role=Role.PREFILL))
    decode = Engine(config.with_scheduler(role=Role.DECODE))
    taken = decode.allocate(3 * 16)  # so the decode side's block ids differ from prefill's
    for i, prompt in enumerate(ids):
        prefill.add_request(f"r{i}", prompt, PARAMS)
    run(prefill)
    moved = []
    for i, prompt in enumerate(ids):
        parked = prefill.scheduler.parked[f"r{i}"]
        blocks = decode.allocate(len(prompt))
        assert blocks is not None
        request = Request(parked.request_id, prompt, PARAMS, output_ids=list(parked.output_ids),
                          output_logprobs=list(parked.output_logprobs))
        decode.admit_imported(request, blocks, prefill.export_kv(parked.request_id))
        assert prefill.release(parked.request_id)
        moved.append(request)
    run(decode)
    assert taken is not None
    decode.free(taken)
    assert decode.blocks.num_free == decode.blocks.num_blocks
    assert prefill.blocks.num_free == prefill.blocks.num_blocks
    return moved


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["batched", "chunked", "disaggregated"])
def test_generated_tokens_score_as_transformers_scores_them(device: str, dtype: str,
                                                            mode: str) -> None:
    config = EngineConfig(model=SHAPE, device=device, dtype=dtype, seed=5)
    ids = prompts()
    if mode == "disaggregated":
        requests = disaggregated(config, ids)
    else:
        chunked = mode == "chunked"  # a budget of 16 tokens: long prompts take several steps
        engine = Engine(config.with_scheduler(chunked_prefill=chunked,
                                              max_batch_tokens=16 if chunked else 256))
        requests = [engine.add_request(f"c{i}", p, PARAMS) for i, p in enumerate(ids[:3])]
        engine.step()  # the rest join mid-way
        requests += [engine.add_request(f"d{i}", p, PARAMS) for i, p in enumerate(ids[3:])]
        run(engine)
        assert engine.runner.device.type == torch.device(device).type
    hf = load_hf_reference(SHAPE, engine_dtype := getattr(torch, dtype), device, seed=5)
    worst = 0.0
    for prompt, request in zip(ids, requests, strict=True):
        assert len(request.output_ids) == PARAMS.max_tokens
        ours = torch.tensor(request.output_logprobs)
        theirs = hf_logprobs(hf, prompt, request.output_ids).cpu()
        worst = max(worst, float((ours - theirs).abs().max()))
    assert worst < TOLERANCE[engine_dtype], f"{device} {dtype} {mode}: off by {worst:.2e}"
    # the draws are seeded: varied tokens, so the decode steps' logits are really compared
    assert len({t for r in requests for t in r.output_ids}) > 2 * len(requests)
