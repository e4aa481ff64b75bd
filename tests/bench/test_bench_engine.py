"""`distserve bench engine`'s bandwidth bound, on a tiny random-weight model."""

import pytest

from distserve.commands.bench_engine import bandwidth_bound
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine


@pytest.mark.parametrize("context", [16, 256])
def test_the_bound_counts_the_kv_a_step_reads(context: int) -> None:
    engine = Engine(EngineConfig(model="tiny", threads=1).with_scheduler(max_running=2))
    try:
        bound = bandwidth_bound(engine, context, rounds=2)
    finally:
        engine.close()
    config = engine.model_config
    # K and V of every layer and KV head, float32, for each token of the context
    assert bound.kv_bytes == context * config.num_layers * 2 * config.num_kv_heads \
        * config.head_dim * 4
    read = engine.runner.model.weight_bytes() + bound.kv_bytes
    assert bound.ms == pytest.approx(read / bound.gbps / 1e6)
    assert bound.gbps > 0 and bound.step_ms > 0
