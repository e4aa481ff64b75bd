"""Parallel instances: a model split over ranks (real processes, gloo), by heads (tp), by
layers (pp) or both, generates exactly the tokens of the whole model, batched, joining mid-way
and across a KV move between instances of different tp and pp; a rank that dies fails its
instance at once, and ranks die with rank 0."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from shared.engine.attention import AttentionMetadata, DecodeGroup, PrefillSegment
from shared.engine.config import EngineConfig, ModelConfig, Role
from shared.engine.engine import Engine
from shared.engine.loader import LoadedModel, load
from shared.engine.parallel.group import Collective, RankFailed, rank_threads
from shared.engine.parallel.layout import RankPlace, check_tp, shard_config, stage_layers
from shared.engine.parallel.packet import pack, unpack
from shared.engine.parallel.sharding import ShardedWeights, narrow
from shared.engine.quant import quantize
from shared.engine.request import Request, SamplingParams
from tests.engine.conftest import NEW_TOKENS, prefill_then_decode
from tests.model_dirs import write_random

CPU = torch.device("cpu")
GREEDY = SamplingParams(max_tokens=NEW_TOKENS)
KV = 32 << 20


# -- pure: how weights split, and the step packet ------------------------------------------

def test_a_tp_that_does_not_divide_the_heads_is_refused() -> None:
    smollm2 = ModelConfig(
        name="smollm2", vocab_size=10, hidden_size=576, intermediate_size=1536, num_layers=1,
        num_heads=9, num_kv_heads=3, head_dim=64)
    assert shard_config(smollm2, 3).num_heads == 3
    with pytest.raises(ValueError, match="3 KV heads: tp 2"):
        check_tp(smollm2, 2)
    narrow_heads = dataclasses.replace(smollm2, num_heads=8, num_kv_heads=8, head_dim=8)
    check_tp(narrow_heads, 4)
    with pytest.raises(ValueError, match="query columns"):  # 64 / 4 = 16: half a block
        check_tp(narrow_heads, 4, quantized=True)


@pytest.mark.parametrize("tp", [2, 4])
def test_the_ranks_parts_make_up_each_weight(tp: int) -> None:
    config = ModelConfig(
        name="t", vocab_size=64, hidden_size=256, intermediate_size=512, num_layers=1,
        num_heads=8, num_kv_heads=4, head_dim=32, tie_embeddings=False)
    full = {"layers.0.q_proj": torch.randn(256, 256), "layers.0.k_proj": torch.randn(128, 256),
            "layers.0.o_proj": torch.randn(256, 256), "layers.0.down_proj": torch.randn(256, 512),
            "layers.0.input_layernorm": torch.randn(256)}
    shards = [ShardedWeights(full, config, rank, tp) for rank in range(tp)]
    for name, dim in (("q_proj", 0), ("k_proj", 0), ("o_proj", 1), ("down_proj", 1)):
        parts = [s[f"layers.0.{name}"] for s in shards]
        assert torch.equal(torch.cat(parts, dim), full[f"layers.0.{name}"])  # type: ignore
    assert all(s["layers.0.input_layernorm"] is full["layers.0.input_layernorm"] for s in shards)
    # quantized: a rank's input columns are whole blocks, the same blocks as the whole matrix's
    q = quantize(full["layers.0.down_proj"], 4)
    parts = [narrow(q, 1, rank * 512 // tp, 512 // tp) for rank in range(tp)]
    assert torch.equal(torch.cat([p.dequantize() for p in parts], 1), q.dequantize())


def test_stages_take_contiguous_layers_and_hand_on_to_their_peer() -> None:
    assert stage_layers(30, 4) == [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]
    assert stage_layers(2, 1) == [range(0, 2)]
    with pytest.raises(ValueError, match="pp 3 needs between 1 and the model's 2 layers"):
        stage_layers(2, 3)
    # 2 stages of tp 3: ranks 0-2, then 3-5; the last stage's first rank returns to rank 0
    places = [RankPlace(rank, tp=3, pp=2) for rank in range(6)]
    assert [(p.stage, p.tp_rank) for p in places] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1),
                                                      (1, 2)]
    assert [p.source for p in places] == [None, None, None, 0, 1, 2]
    assert [p.target for p in places] == [3, 4, 5, 0, None, None]
    assert places[4].kv_heads(3) == range(1, 2) and places[4].layers(30) == range(15, 30)
    assert RankPlace().target is None and RankPlace().source is None


def test_a_step_packet_unpacks_to_the_same_inputs() -> None:
    ids, positions = torch.tensor([5, 6, 7, 8, 9, 10]), torch.tensor([0, 1, 2, 4, 9, 30])
    meta = AttentionMetadata(
        slots=torch.tensor([16, 17, 18, 36, 41, 62]),
        prefills=[PrefillSegment(0, 3, 0, torch.empty(0, dtype=torch.long)),
                  PrefillSegment(3, 1, 4, torch.tensor([2]))],
        decode=DecodeGroup.of(4, torch.tensor([[2, 0], [3, 1]]), torch.tensor([10, 31]), 16))
    got_ids, got_positions, got = unpack(pack(ids, positions, meta), 16, CPU)
    assert torch.equal(got_ids, ids) and torch.equal(got_positions, positions)
    assert torch.equal(got.slots, meta.slots)
    assert [(s.start, s.length, s.cached, s.block_table.tolist()) for s in got.prefills] == \
        [(0, 3, 0, []), (3, 1, 4, [2])]
    assert got.decode is not None and meta.decode is not None
    for field in ("block_tables", "context_lens", "mask"):
        assert torch.equal(getattr(got.decode, field), getattr(meta.decode, field))
    assert got.decode.start == 4


class _Work:
    """A gloo Work whose sliced waits time out `slices` times, then ends with `error` (or
    not): it ends just after the last slice's wait gave up, before anyone asked."""

    def __init__(self, slices: int, error: str | None = None) -> None:
        self.slices, self.error, self.waits = slices, error, 0

    def wait(self, timeout: timedelta | None = None) -> None:
        self.waits += 1
        if timeout is not None and self.waits <= self.slices:
            raise RuntimeError("Operation timed out!")
        if self.error:
            raise RuntimeError(self.error)

    def is_completed(self) -> bool:
        return self.waits >= self.slices


def test_a_collective_that_ends_as_its_wait_times_out_is_done_and_one_that_failed_is_not(
        ) -> None:
    checks = []
    group = Collective(None, 0, 2, timedelta(seconds=60), check=lambda: checks.append(1))
    done = _Work(slices=3)
    group.wait(done, sliced=True)  # raised "Operation timed out!" (a CLI profile, 2 ranks)
    assert done.waits == 4 and len(checks) == 2  # the ranks checked while it ran
    with pytest.raises(RuntimeError, match="connection closed"):
        group.wait(_Work(slices=1, error="connection closed"), sliced=True)
    group = Collective(None, 0, 2, timedelta(0), check=lambda: None)
    with pytest.raises(RuntimeError, match="timed out"):  # the group's own timeout
        group.wait(_Work(slices=10), sliced=True)


def test_ranks_leave_a_core_each_to_their_collectives_where_they_would_fill_the_host() -> None:
    """By default the ranks share the cores, less one a rank for gloo's I/O threads where a
    rank's share is 4 or more (a 16-core host at tp 4: 3 threads a rank); a thread count
    given is split as given."""
    def threads(cores: int, tp: int = 1, pp: int = 1, given: int = 0) -> int:
        return rank_threads(EngineConfig(tp=tp, pp=pp, threads=given), cores)

    assert threads(16, tp=4) == 3 and threads(16, tp=2) == 7 and threads(16, pp=2) == 7
    assert threads(16) == 16  # one rank: no collectives
    assert threads(2, tp=2) == 1 and threads(8, tp=3) == 2  # a thread is too much of a share
    assert threads(16, tp=4, given=16) == 4 and threads(16, tp=2, given=6) == 3


# -- real ranks --------------------------------------------------------------------------

def staggered(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """Continuous batching: prompt i joins at step 2i, while the earlier ones decode."""
    requests: list[Request] = []
    step = 0
    while len(requests) < len(prompts) or engine.has_work():
        if len(requests) < len(prompts) and step % 2 == 0:
            requests.append(engine.add_request(f"s{len(requests)}", prompts[len(requests)],
                                               GREEDY))
        engine.step()
        step += 1
    return [r.output_ids for r in requests]


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp"), [(3, 1), (1, 2)])
def test_smollm2_split_over_ranks_generates_the_tokens_of_one(
        tp: int, pp: int, loaded: LoadedModel, prompt_ids: list[list[int]]) -> None:
    whole = Engine(EngineConfig(kv_cache_bytes=KV), loaded)
    expected = [r.output_ids for r in whole.generate(prompt_ids, GREEDY)]
    split = Engine(EngineConfig(tp=tp, pp=pp, kv_cache_bytes=KV))
    try:
        shard = split.runner.model.shard
        assert (shard.num_heads, shard.num_kv_heads, shard.num_layers) == (9 // tp, 3 // tp,
                                                                           30 // pp)
        under_way = count_under_way(split)
        assert [r.output_ids for r in split.generate(prompt_ids, GREEDY)] == expected
        assert staggered(split, prompt_ids) == expected
        assert split.blocks.num_free == split.blocks.num_blocks
        assert max(under_way) == pp  # a stage's micro-batch each, at once
    finally:
        split.close()


def count_under_way(engine: Engine) -> list[int]:
    """How many steps are under way as each one is launched, as the engine runs."""
    counts, now = [], [0]
    launch, finish = engine.runner.launch, engine.runner.finish

    def launching(*args: object) -> object:
        now[0] += 1
        counts.append(now[0])
        return launch(*args)  # type: ignore[arg-type]

    def finishing(*args: object) -> object:
        now[0] -= 1
        return finish(*args)  # type: ignore[arg-type]

    engine.runner.launch, engine.runner.finish = launching, finishing  # type: ignore[method-assign]
    return counts


@pytest.mark.slow
def test_a_request_aborted_while_its_micro_batch_is_under_way_gets_no_more_tokens() -> None:
    """Nor an error when that micro-batch then fails (in sampling, on rank 0): only the
    step's other request gets one; the rest run to the end and every block comes back."""
    engine = Engine(EngineConfig(model="tiny", pp=2, kv_cache_bytes=1 << 20))
    try:
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        requests = [engine.add_request(f"r{i}", [1 + i, 2, 3], params) for i in range(4)]
        while any(not r.output_ids for r in requests):
            engine.step()
        engine.step()  # launches both halves, finishes the first
        (behind,) = engine._under_way  # the second half, still in the pipeline
        victim, other = (c.request for c in behind.out.chunks)
        held = len(victim.output_ids)
        assert engine.abort(victim.request_id)
        model = engine.runner.model
        logits = model.logits

        def broken(*_: object) -> torch.Tensor:
            model.logits = logits  # type: ignore[method-assign]
            raise RuntimeError("sampling fell over")

        model.logits = broken  # type: ignore[method-assign]
        outputs = []
        while engine.has_work():
            outputs += engine.step()
        assert {o.request_id for o in outputs if o.error} == {other.request_id}
        assert all(o.request_id != victim.request_id for o in outputs)
        assert len(victim.output_ids) == held
        assert all(len(r.output_ids) == 8 for r in requests if r not in (victim, other))
        assert engine.blocks.num_free == engine.blocks.num_blocks
    finally:
        engine.close()


@pytest.mark.slow
def test_ranks_wait_for_commands_longer_than_a_collective_may_take(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An instance idle for longer than DS_COLLECTIVE_TIMEOUT_S still serves: its ranks
    wait for rank 0's next command without a deadline (they used to exit after 10 minutes
    of idling, failing the next request)."""
    monkeypatch.setenv("DS_COLLECTIVE_TIMEOUT_S", "8")  # long enough for a busy host's steps
    engine = Engine(EngineConfig(model="tiny", tp=2, pp=2, kv_cache_bytes=1 << 20))
    try:
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        first = engine.generate([[1, 2, 3]], params)[0].output_ids
        time.sleep(11)
        assert engine.generate([[1, 2, 3]], params)[0].output_ids == first
    finally:
        engine.close()


@pytest.fixture(scope="module")
def eight_heads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Random 8-head models (8 KV heads: tp 2, 4 and 8 divide them)."""
    root = tmp_path_factory.mktemp("tp")
    shape = dict(num_attention_heads=8, num_key_value_heads=8, head_dim=8)
    return {arch: write_random(root / arch, arch, **shape) for arch in ("llama", "qwen2")}


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "tp", "pp"), [("qwen2", 2, 1), ("llama", 4, 1),
                                                ("llama", 2, 2)])
def test_random_eight_head_models_split_over_ranks_generate_as_whole(
        eight_heads: dict[str, Path], arch: str, tp: int, pp: int) -> None:
    """Qwen2's Q/K/V biases split with their heads; Llama's untied LM head stays on rank 0;
    2 stages of 2 ranks each reduce within their stage."""
    model = str(eight_heads[arch])
    prompts = [[(i * 7919 + j * 104729) % 49000 + 100 for j in range(5 + 3 * i)]
               for i in range(8)]
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    whole = Engine(EngineConfig(model=model, kv_cache_bytes=KV), load(model, 0, CPU,
                                                                       torch.float32))
    expected = [r.output_ids for r in whole.generate(prompts, params)]
    assert len({tuple(t) for t in expected}) == 8  # not one degenerate continuation
    split = Engine(EngineConfig(model=model, tp=tp, pp=pp, kv_cache_bytes=KV))
    try:
        assert [r.output_ids for r in split.generate(prompts, params)] == expected
    finally:
        split.close()


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp"), [(3, 1), (1, 2)])
def test_kv_moves_between_instances_of_different_parallelism(
        tp: int, pp: int, loaded: LoadedModel, prompt_ids: list[list[int]]) -> None:
    """A split prefill instance's KV (each rank's layers and heads sent to rank 0) decodes on
    a one-rank instance, and a one-rank instance's on a split one (each rank sent its
    layers' heads): the tokens of one rank."""
    config = EngineConfig(kv_cache_bytes=KV)
    whole = Engine(config, loaded)
    expected = [r.output_ids for r in whole.generate(prompt_ids, GREEDY)]
    one = {role: Engine(config.with_scheduler(role=role), loaded)
           for role in (Role.PREFILL, Role.DECODE)}
    for prefill_role, decode_role in ((Role.PREFILL, None), (None, Role.DECODE)):
        role = prefill_role or decode_role
        split = Engine(dataclasses.replace(config, tp=tp, pp=pp).with_scheduler(role=role))
        try:
            prefill = split if prefill_role else one[Role.PREFILL]
            decode = split if decode_role else one[Role.DECODE]
            moved = prefill_then_decode(prefill, decode, prompt_ids, GREEDY)
            assert [r.output_ids for r in moved] == expected
            assert split.blocks.num_free == split.blocks.num_blocks
        finally:
            split.close()


@pytest.mark.slow
@pytest.mark.parametrize("when", ["between steps", "during a step"])
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_a_rank_that_dies_fails_its_instance_at_once(when: str, tp: int, pp: int) -> None:
    engine = Engine(EngineConfig(model="tiny", tp=tp, pp=pp, kv_cache_bytes=1 << 20))
    try:
        assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4))[0].output_ids
        (rank1,) = engine.runner.ranks.processes  # type: ignore[union-attr]
        if when == "between steps":
            rank1.kill()
            rank1.wait()
        else:  # stopped: it takes the step's inputs, then never answers (all-reduce, hand-off)
            rank1.send_signal(signal.SIGSTOP)
            threading.Timer(1.0, rank1.kill).start()
        engine.add_request("after", [1, 2, 3], SamplingParams(max_tokens=4))
        started = time.monotonic()
        with pytest.raises(RankFailed, match="rank 1 exited with -9"):
            engine.step()
        assert time.monotonic() - started < 60  # seen, not gloo's 10-minute timeout
    finally:
        engine.close()


@pytest.mark.slow
def test_a_failure_of_rank_0_mid_step_fails_the_instance() -> None:
    """The other ranks are mid-step (waiting in an all-reduce): the instance cannot go on,
    and closing it does not wait for them."""
    engine = Engine(EngineConfig(model="tiny", tp=2, kv_cache_bytes=1 << 20))
    try:
        def broken(*_: object) -> torch.Tensor:
            raise RuntimeError("injected")

        engine.runner.model.forward = broken  # type: ignore[method-assign]
        engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4))
        with pytest.raises(RankFailed, match="rank 0 failed mid-step: RuntimeError: injected"):
            engine.step()
    finally:
        started = time.monotonic()
        engine.close()
        assert time.monotonic() - started < 30
    assert all(p.poll() is not None for p in engine.runner.ranks.processes)  # type: ignore


@pytest.mark.slow
def test_a_model_the_tp_cannot_split_is_refused_by_every_rank() -> None:
    with pytest.raises(ValueError, match="tiny has 2 KV heads: tp 3 does not divide them"):
        Engine(EngineConfig(model="tiny", tp=3, kv_cache_bytes=1 << 20))
    with pytest.raises(ValueError, match="run on the CPU"):
        Engine(EngineConfig(model="tiny", tp=2, device="cuda"))


RANK0 = """
import sys
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
engine = Engine(EngineConfig(model="tiny", tp=2, kv_cache_bytes=1 << 20))
print(*(p.pid for p in engine.runner.ranks.processes), flush=True)
sys.stdin.read()
"""


@pytest.mark.slow
def test_the_ranks_die_with_rank_0() -> None:
    rank0 = subprocess.Popen([sys.executable, "-c", RANK0], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert rank0.stdout is not None
    pids = [int(p) for p in rank0.stdout.readline().split()]
    assert len(pids) == 1 and all(alive(p) for p in pids)
    rank0.send_signal(signal.SIGKILL)
    rank0.wait()
    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped by init, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
