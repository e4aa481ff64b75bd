"""A step that fails (model, sampling, update) fails only its own requests: they are aborted
with an error output and their blocks freed, and the engine goes on (tiny random model)."""

from __future__ import annotations

import logging

import pytest

from shared.engine.config import EngineConfig, Role
from shared.engine.engine import Engine, RequestOutput
from shared.engine.request import RequestStatus, SamplingParams
from shared.engine.scheduler import SchedulerOutput

pytestmark = pytest.mark.timeout(60)

BOOM = "the device fell over"


def tiny_engine(**scheduler: object) -> Engine:
    config = EngineConfig(model="tiny", device="cpu", kv_cache_bytes=1 << 20)
    return Engine(config.with_scheduler(**scheduler))


def fail_once(monkeypatch: pytest.MonkeyPatch, engine: Engine, request_id: str,
              in_update: bool = False) -> None:
    """The next step holding `request_id` fails: in the runner, or (in_update) in the
    scheduler's update, after the requests before it have advanced."""
    execute = engine.runner.execute
    armed = [True]

    def failing(out: SchedulerOutput) -> dict[str, tuple[int, float | None]]:
        if not armed[0] or all(c.request.request_id != request_id for c in out.chunks):
            return execute(out)
        armed[0] = False
        if not in_update:
            raise RuntimeError(BOOM)
        sampled = execute(out)
        del sampled[request_id]  # update raises KeyError when it reaches this request
        return sampled

    monkeypatch.setattr(engine.runner, "execute", failing)


def run_all(engine: Engine) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    while engine.has_work():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def assert_all_free(engine: Engine) -> None:
    assert engine.blocks.num_free == engine.blocks.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert not engine.scheduler.parked


def test_a_failed_prefill_fails_only_its_request(monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    reference = tiny_engine()
    (expected,) = reference.generate([[1, 2, 3]], SamplingParams(max_tokens=6))
    engine = tiny_engine()
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=6))
    before = engine.step() + engine.step()  # a is decoding
    fail_once(monkeypatch, engine, "bad")
    engine.add_request("bad", list(range(40)), SamplingParams(max_tokens=4))
    with caplog.at_level(logging.ERROR):
        (failed,) = engine.step()  # a prefill step: "bad" alone
    assert failed.request_id == "bad" and failed.finished and not failed.new_token_ids
    assert failed.error is not None and BOOM in failed.error
    assert any(r.exc_info is not None and BOOM in str(r.exc_info[1]) for r in caplog.records)
    assert engine.scheduler.get("bad") is None
    rest = run_all(engine)
    assert set(rest) == {"a"} and rest["a"][-1].finish_reason == "length"
    assert tokens(before + rest["a"]) == expected.output_ids  # untouched by the failure
    assert_all_free(engine)
    engine.add_request("c", [4, 5], SamplingParams(max_tokens=3))
    assert run_all(engine)["c"][-1].finish_reason == "length"
    assert_all_free(engine)


@pytest.mark.parametrize("in_update", [False, True])
@pytest.mark.parametrize("chunked", [False, True])
def test_a_failed_decode_step_fails_the_whole_batch(monkeypatch: pytest.MonkeyPatch,
                                                    in_update: bool, chunked: bool) -> None:
    engine = tiny_engine(chunked_prefill=chunked)
    for request_id in "abc":
        engine.add_request(request_id, [1, 2, 3, 4], SamplingParams(max_tokens=8))
    engine.step()  # all three prefilled together
    fail_once(monkeypatch, engine, "b", in_update)
    outputs = engine.step()
    assert sorted(o.request_id for o in outputs) == ["a", "b", "c"]
    assert all(o.finished and o.error for o in outputs)
    assert_all_free(engine)
    engine.add_request("d", [9], SamplingParams(max_tokens=3))
    assert tokens(run_all(engine)["d"]) and engine.blocks.num_free == engine.blocks.num_blocks


def test_a_failed_chunk_frees_a_half_prefilled_request(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = tiny_engine(chunked_prefill=True, max_batch_tokens=16)
    engine.add_request("long", list(range(50)), SamplingParams(max_tokens=2))
    assert engine.step() == []  # the first chunk samples nothing
    request = engine.scheduler.get("long")
    assert request is not None and request.num_computed == 16
    fail_once(monkeypatch, engine, "long")
    (failed,) = engine.step()
    assert failed.error and request.status is RequestStatus.FINISHED_ABORTED
    assert_all_free(engine)


def test_a_failure_leaves_parked_requests_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = tiny_engine(role=Role.PREFILL)
    engine.add_request("parked", [1, 2, 3], SamplingParams(max_tokens=4))
    (first,) = engine.step()
    assert first.parked
    held = list(engine.scheduler.parked["parked"].block_table)
    fail_once(monkeypatch, engine, "bad", in_update=True)
    engine.add_request("bad", [4, 5, 6], SamplingParams(max_tokens=4))
    (failed,) = engine.step()
    assert failed.request_id == "bad" and failed.error and not failed.parked
    assert engine.scheduler.parked["parked"].block_table == held
    assert engine.release("parked")
    assert_all_free(engine)


def test_outputs_name_which_copy_of_a_request_they_come_from() -> None:
    """A request id queued again (a failover brings it back) replaces the older copy; the
    outputs carry the copy's admission number, so a worker can tell the older copy's
    outputs (already computed when the new one came) from the new one's."""
    engine = tiny_engine(role=Role.PREFILL)
    params = SamplingParams(max_tokens=4)
    first = engine.add_request("r", [1, 2, 3, 4], params)
    older = engine.step()
    assert [(o.request_id, o.arrival, o.parked) for o in older] == [("r", first.arrival, True)]
    second = engine.add_request("r", [1, 2, 3, 4], params, output_ids=older[0].new_token_ids)
    assert second.arrival != first.arrival
    assert engine.scheduler.parked == {}  # the older copy's KV is freed
    newer = engine.step()
    assert [(o.request_id, o.arrival, o.index) for o in newer] == [("r", second.arrival, 1)]
    engine.release("r")
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_a_step_names_the_prompts_it_began() -> None:
    """`last_began`: the requests whose prompt the step began computing, a chunked prompt at
    its first chunk only (a colocated worker's "prefill queue" span ends there)."""
    engine = tiny_engine(chunked_prefill=True, max_batch_tokens=16)
    engine.add_request("long", list(range(40)), SamplingParams(max_tokens=2))
    engine.step()
    assert [request_id for request_id, _ in engine.last_began] == ["long"]
    engine.add_request("short", [5, 6, 7], SamplingParams(max_tokens=2))
    began = []
    while engine.has_work():  # long's later chunks, short's prompt, the decodes
        engine.step()
        began.append([request_id for request_id, _ in engine.last_began])
    assert [ids for ids in began if ids] == [["short"]] and began[-1] == []


def test_the_engine_says_whether_the_step_under_way_computes_prompt_tokens(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Read by the heartbeats (a stuck decode instance's streams move at once only where its
    step computes no prompt: a recompute after preemption may be long by rights): true while
    a prompt's step runs, false while a decode step runs, between steps, and after a step
    that failed."""
    engine = tiny_engine()
    seen: list[tuple[bool, bool]] = []  # (prompt tokens in the step, what the engine said)
    execute = engine.runner.execute

    def watched(out: SchedulerOutput) -> object:
        seen.append((bool(out.prefills), engine.prompts_under_way))
        return execute(out)

    monkeypatch.setattr(engine.runner, "execute", watched)
    engine.add_request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3))
    while engine.has_work():
        engine.step()
        assert not engine.prompts_under_way
    assert seen == [(True, True), (False, False), (False, False)]
    fail_once(monkeypatch, engine, "b")
    engine.add_request("b", [1, 2, 3], SamplingParams(max_tokens=2))
    assert engine.step()[0].error and not engine.prompts_under_way
