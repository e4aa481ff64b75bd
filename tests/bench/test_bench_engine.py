"""`distserve bench engine`'s bandwidth bound, on a tiny random-weight model."""

import json

import pytest

from distserve.bench.engine import bandwidth_bound
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


def test_a_random_shape_is_benchmarked_against_hf_on_its_own_weights(
        capsys: pytest.CaptureFixture[str]) -> None:
    from distserve.cli import main

    assert main(["bench", "engine", "--model", "tiny", "--device", "cpu", "--threads", "1",
                 "--lengths", "16", "--batches", "2", "--context", "32", "--steps", "3",
                 "--repeats", "2", "--json"]) == 0
    results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("prefill_ms", "hf_prefill_ms"):
        assert results[key]["16"] > 0
    for key in ("decode_step_ms", "hf_decode_step_ms"):
        assert results[key]["2"] > 0
    for kind, size in (("prefill", "16"), ("decode_step", "2")):
        # HF's time over the engine's within each interleaved round, lowest and highest
        low, high = results[f"{kind}_ratio_range"][size]
        assert 0 < low <= high


@pytest.mark.parametrize("how", ["--no-hf", "transformers not installed"])
def test_without_hf_the_ratios_are_left_out(capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    import distserve.bench.engine as bench_engine
    from distserve.cli import main

    if how != "--no-hf":  # as after `make install`, which leaves the test extras out
        monkeypatch.setattr(bench_engine, "hf_installed", lambda: False)
    assert main(["bench", "engine", "--model", "tiny", "--device", "cpu", "--threads", "1",
                 "--lengths", "16", "--batches", "2", "--context", "32", "--steps", "2",
                 "--repeats", "1", "--json"] + ([how] if how == "--no-hf" else [])) == 0
    out, tables = capsys.readouterr()
    said = "HF transformers is not installed (it comes with the test extras: pip install -e " \
        "'.[test]')"
    assert (said in " ".join(tables.split())) == (how != "--no-hf")  # the lines joined
    results = json.loads(out.strip().splitlines()[-1])
    assert results["decode_step_ms"]["2"] > 0 and results["hf_decode_step_ms"] == {}
    assert results["prefill_ratio_range"] == results["decode_step_ratio_range"] == {}
    decode_row = next(line for line in tables.split("Decode step")[1].splitlines()
                      if line.startswith("│") and "2 │" in line)
    assert [cell.strip() for cell in decode_row.strip("│").split("│")][2:] == ["-", "-", "-"]
