"""A KV budget too small for one block is a user's mistake: a ValueError saying the smallest
budget that holds one, never an AssertionError (tiny random model; a 7B shape's arithmetic)."""

from __future__ import annotations

import pytest
import torch

from shared.engine.config import LLAMA_SHAPES, EngineConfig
from shared.engine.engine import Engine
from shared.engine.kv_cache import MIB, KVCache
from shared.engine.parallel.layout import kv_block_bytes, kv_budget_problem

pytestmark = pytest.mark.timeout(60)
LLAMA_7B = LLAMA_SHAPES["llama-2-7b"]  # 32 layers of 32 KV heads of 128: 1 MiB a float32 token


def test_a_block_of_a_rank_is_its_share_of_the_heads_over_its_widest_stage() -> None:
    assert kv_block_bytes(LLAMA_7B, 1, 1, 16, 4) == 16 * MIB
    assert kv_block_bytes(LLAMA_7B, 2, 1, 16, 2) == 4 * MIB
    assert kv_block_bytes(LLAMA_7B, 1, 3, 16, 4) == 16 * MIB * 11 // 32  # 11, 11, 10 layers


def test_a_budget_under_one_block_says_the_smallest_that_holds_one() -> None:
    assert kv_budget_problem(16 * MIB, 16 * MIB, 16, "llama-2-7b") is None
    problem = kv_budget_problem(8 * MIB, 16 * MIB, 16, "llama-2-7b")
    assert problem == ("a KV cache of 8 MiB holds no block of llama-2-7b (a block of 16 tokens "
                       "takes 16 MiB a rank): give --kv-cache-mb 16 or more")


def test_an_engine_whose_budget_holds_no_block_refuses_with_a_value_error() -> None:
    config = EngineConfig(model="tiny", device="cpu", kv_cache_bytes=1000)
    with pytest.raises(ValueError, match=r"holds no block of tiny .* give --kv-cache-mb 1 or "
                                         "more"):
        Engine(config)
    with pytest.raises(ValueError, match="holds no block"):
        KVCache.from_budget(LLAMA_SHAPES["tiny"], 1000, 16, torch.float32, torch.device("cpu"))
    engine = Engine(config.with_scheduler(block_size=1))  # 512 bytes a block: one fits
    assert engine.blocks.num_blocks == 1
