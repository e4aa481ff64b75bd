"""The scheduler is pure: these tests drive it with a fake 'model' that returns fixed tokens."""

import threading
import time

import pytest

from shared.engine.block_manager import BlockManager
from shared.engine.config import Role, SchedulerConfig
from shared.engine.request import Request, RequestStatus, SamplingParams
from shared.engine.scheduler import Scheduler, SchedulerOutput, StepShape


def make(role: Role = Role.COLOCATED, blocks: int = 64, **kw: object) -> Scheduler:
    config = SchedulerConfig(role=role, block_size=4, **kw)  # type: ignore[arg-type]
    return Scheduler(config, BlockManager(blocks, 4))


def req(rid: str, prompt_len: int, max_tokens: int = 4, arrival: int = 0) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
                   arrival=arrival)


def run_step(s: Scheduler, token: int = 7) -> SchedulerOutput | None:
    out = s.schedule()
    if out is not None:
        for chunk in out.chunks:
            chunk.request.check(s.blocks.block_size)
        s.update(out, {c.request.request_id: (token, None) for c in out.chunks if c.samples})
    return out


def drain(s: Scheduler, limit: int = 1000) -> None:
    for _ in range(limit):
        if run_step(s) is None:
            return
    raise AssertionError("scheduler did not finish")


def test_prefill_batches_up_to_token_budget_but_always_admits_one() -> None:
    s = make(max_batch_tokens=10)
    for i, n in enumerate([4, 4, 4]):
        s.add(req(f"r{i}", n, arrival=i))
    out = s.schedule()
    assert out is not None
    assert [c.request.request_id for c in out.prefills] == ["r0", "r1"]  # 8 <= 10 < 12
    assert not out.decodes
    big = make(max_batch_tokens=10)
    big.add(req("long", 25))
    out = big.schedule()
    assert out is not None and out.prefills[0].length == 25  # over budget, alone


def test_colocated_prioritises_prefill_then_decodes_together() -> None:
    s = make(max_batch_tokens=100)
    s.add(req("a", 5, arrival=0))
    out = run_step(s)
    assert out is not None and out.prefills and not out.decodes
    s.add(req("b", 3, arrival=1))
    out = run_step(s)  # the new prompt goes before a's decode (vLLM-style)
    assert out is not None and [c.request.request_id for c in out.prefills] == ["b"]
    out = run_step(s)
    assert out is not None and sorted(c.request.request_id for c in out.decodes) == ["a", "b"]
    assert all(c.length == 1 for c in out.decodes)


def test_chunked_prefill_mixes_decodes_and_prefill_chunks_within_budget() -> None:
    s = make(max_batch_tokens=6, chunked_prefill=True)
    s.add(req("a", 2, max_tokens=10, arrival=0))
    run_step(s)
    s.add(req("b", 13, arrival=1))
    out = run_step(s)
    assert out is not None
    assert [(c.request.request_id, c.length) for c in out.decodes] == [("a", 1)]
    assert [(c.request.request_id, c.length) for c in out.prefills] == [("b", 5)]
    assert not out.prefills[0].samples
    # what the latency model prices: b's 5 tokens, a's decode over its 3 tokens
    assert out.shape() == StepShape((5,), 1, 3)
    lengths = []
    while (out := run_step(s)) is not None and any(c.request.request_id == "b"
                                                   for c in out.prefills):
        lengths.append(out.prefills[0].length)
        assert out.num_tokens <= 6
        shape = out.shape()  # a later chunk attends to the tokens before it
        assert shape is not None and shape.done == (5 + sum(lengths[:-1]),)
    assert sum(lengths) == 13 - 5


def test_finish_on_max_tokens_frees_every_block() -> None:
    s = make(blocks=16)
    for i in range(3):
        s.add(req(f"r{i}", 6, max_tokens=5, arrival=i))
    drain(s)
    assert s.blocks.num_free == 16
    assert not s.running and not s.waiting


@pytest.mark.parametrize("caching", [False, True])
def test_preempts_newest_when_pool_runs_out_and_resumes_it(caching: bool) -> None:
    # 6 blocks of 4 tokens: two requests of 8 prompt tokens need 2 blocks each, then grow.
    s = make(blocks=6, watermark_blocks=0, prefix_caching=caching)
    old, new = req("old", 8, max_tokens=12, arrival=0), req("new", 8, max_tokens=12, arrival=1)
    s.add(old)
    s.add(new)
    preempted: list[Request] = []
    starts: list[int] = []  # where each of new's prefills began
    for _ in range(200):
        out = run_step(s)
        if out is None:
            break
        preempted += out.preempted
        starts += [c.start for c in out.prefills if c.request is new]
    assert preempted and preempted[0] is new  # the newest goes first
    # recomputed whole, or from the blocks of its own the pool still held (cached)
    assert starts[0] == 0 and any(start > 0 for start in starts[1:]) is caching
    assert old.status is RequestStatus.FINISHED_LENGTH
    assert new.status is RequestStatus.FINISHED_LENGTH and new.num_preemptions >= 1
    assert len(old.output_ids) == len(new.output_ids) == 12  # nothing lost
    assert s.blocks.num_free == 6


def test_abort_frees_blocks_wherever_the_request_is() -> None:
    s = make(blocks=8)
    running, queued = req("run", 8, arrival=0), req("queued", 4, arrival=1)
    s.add(running)
    run_step(s)
    s.add(queued)
    assert s.blocks.num_free < 8
    assert s.abort("run") is running and running.status is RequestStatus.FINISHED_ABORTED
    assert s.abort("queued") is queued
    assert s.abort("unknown") is None
    assert s.blocks.num_free == 8 and not s.has_work


def test_prefill_role_parks_until_release() -> None:
    s = make(Role.PREFILL, blocks=8)
    r = req("p", 6, max_tokens=8)
    s.add(r)
    run_step(s)
    assert r.status is RequestStatus.PARKED and r.output_ids == [7]
    assert s.schedule() is None  # parked requests do not decode here
    assert s.blocks.num_free == 8 - 2
    assert s.release("p") is r
    assert s.blocks.num_free == 8


def test_prefill_role_frees_a_request_that_finished_at_its_first_token() -> None:
    s = make(Role.PREFILL, blocks=8)
    s.add(req("one", 6, max_tokens=1))
    run_step(s)
    assert not s.parked and s.blocks.num_free == 8


def test_decode_role_admits_imported_requests_and_batches_them() -> None:
    s = make(Role.DECODE, blocks=8)
    requests = []
    for i in range(3):
        r = req(f"d{i}", 5, max_tokens=3, arrival=i)
        r.output_ids = [9]
        r.num_computed = 5
        table = s.blocks.allocate(2)
        assert table is not None
        r.block_table = table
        s.add_prefilled(r)
        requests.append(r)
    out = run_step(s)
    assert out is not None and len(out.decodes) == 3 and not out.prefills
    drain(s)
    assert all(len(r.output_ids) == 3 for r in requests)
    assert s.blocks.num_free == 8


def test_max_running_caps_the_batch() -> None:
    s = make(max_running=2, max_batch_tokens=100)
    for i in range(4):
        s.add(req(f"r{i}", 3, arrival=i))
    out = s.schedule()
    assert out is not None and len(out.prefills) == 2


def ids(out: SchedulerOutput | None) -> list[str]:
    assert out is not None
    return [c.request.request_id for c in out.chunks]


def test_micro_batches_split_the_running_decodes_and_leave_out_those_under_way() -> None:
    """A pipeline of 2 stages: the next step is scheduled before the last one's update; it
    decodes the other half of the running requests, and a third finds none left."""
    s = Scheduler(SchedulerConfig(block_size=4, max_batch_tokens=100), BlockManager(64, 4),
                  micro_batches=2)
    for i in range(5):
        s.add(req(f"r{i}", 3, max_tokens=8, arrival=i))
    drain_prefill = run_step(s)
    assert ids(drain_prefill) == ["r0", "r1", "r2", "r3", "r4"]
    first = s.schedule()
    second = s.schedule()
    assert ids(first) == ["r0", "r1", "r2"]  # ceil(5 / 2), oldest first
    assert ids(second) == ["r3", "r4"]
    assert s.schedule() is None  # every running request is under way
    assert first is not None and second is not None
    s.update(first, {c.request.request_id: (7, None) for c in first.chunks})
    assert ids(s.schedule()) == ["r0", "r1", "r2"]  # back once updated
    s.update(second, {c.request.request_id: (7, None) for c in second.chunks})
    assert ids(s.schedule()) == ["r3", "r4"]


def test_a_request_under_way_is_neither_chunked_again_nor_preempted() -> None:
    # chunked: a prompt of 12 in chunks of 4 goes one chunk a step, never two steps at once
    s = Scheduler(SchedulerConfig(block_size=4, max_batch_tokens=4, chunked_prefill=True),
                  BlockManager(64, 4), micro_batches=2)
    s.add(req("long", 12, arrival=0))
    out = s.schedule()
    assert out is not None and out.prefills[0].length == 4
    assert s.schedule() is None
    # the pool runs out: the newest request is under way, so the older one gives way
    s = Scheduler(SchedulerConfig(Role.DECODE, block_size=4, watermark_blocks=0),
                  BlockManager(2, 4), micro_batches=2)
    busy, idle = req("busy", 3, max_tokens=8, arrival=1), req("idle", 4, max_tokens=8)
    for r in (busy, idle):
        r.output_ids, r.num_computed = [9], len(r.prompt_ids)
        table = s.blocks.allocate(1)
        assert table is not None
        r.block_table = table
    s.add_prefilled(busy)
    assert ids(s.schedule()) == ["busy"]  # its 4 tokens fit its block
    s.add_prefilled(idle)  # its 5 need a second block: the pool has none
    assert s.schedule() is None
    assert idle.status is RequestStatus.WAITING and idle.num_preemptions == 1
    assert busy.status is RequestStatus.RUNNING and busy.block_table and busy.in_step


def test_a_block_freed_by_a_preemption_goes_to_the_older_request_not_to_another_thread(
) -> None:
    """A decode service on the CPU takes a pull's blocks on its own thread while the engine
    schedules. The pool is held while a step is chosen: the block the newest request's
    preemption frees goes to the older request that needed it, and a pull asking
    meanwhile waits for the choice (then finds the pool full) rather than taking it and
    leaving the older request to be preempted as well."""
    s = make(Role.DECODE, blocks=2, watermark_blocks=0)
    old, new = req("old", 4, max_tokens=8, arrival=0), req("new", 4, max_tokens=8, arrival=1)
    for r in (old, new):  # a whole block each, full: the next token needs another
        r.output_ids, r.num_computed = [9], 4
        table = s.blocks.allocate(1)
        assert table is not None
        r.block_table = table
        s.add_prefilled(r)
    pulled: list[list[int] | None] = []
    free = s.blocks.free

    def free_then_pull(block_ids: list[int]) -> None:  # a pull asks as the victim's blocks free
        free(block_ids)
        pull = threading.Thread(target=lambda: pulled.append(s.blocks.allocate(1)))
        pull.start()
        pull.join(0.5)  # time enough to take the block, were the pool not held

    s.blocks.free = free_then_pull  # type: ignore[method-assign]
    out = s.schedule()
    assert out is not None and out.preempted == [new]
    assert [c.request for c in out.decodes] == [old] and len(old.block_table) == 2
    deadline = time.monotonic() + 30
    while not pulled and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pulled == [None]  # it waited for the choice, then found the pool full


# -- prefix caching ------------------------------------------------------------------------

def prompt(rid: str, tokens: list[int], arrival: int = 0, **params: object) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=2, **params),  # type: ignore[arg-type]
                   arrival=arrival)


def test_a_prompt_starting_as_an_earlier_one_computes_only_the_rest() -> None:
    s = make(prefix_caching=True, max_batch_tokens=100)
    system = list(range(100, 110))  # 10 tokens: two full blocks of 4, and 2 over
    first = prompt("first", [*system, 1, 2, 3])
    s.add(first)
    drain(s)
    assert first.cached_tokens == 0 and s.blocks.num_free == 64
    assert s.blocks.num_cached == 3  # its full blocks, tokens 0..11 (prompt and output)
    second = prompt("second", [*system, 7, 8, 9, 10, 11], arrival=1)
    s.add(second)
    out = s.schedule()
    assert out is not None and len(out.prefills) == 1
    chunk = out.prefills[0]
    assert (chunk.start, chunk.length) == (8, 7)  # the two system blocks found, the rest run
    assert second.cached_tokens == 8 and s.blocks.num_cached == 1
    assert out.shape() == StepShape((7,), 0, 0, (8,))  # priced as a chunk after 8 tokens
    s.update(out, {"second": (5, None)})
    drain(s)
    assert (s.prefix_queried, s.prefix_hits) == (13 + 15, 8)
    assert s.blocks.num_free == 64


def test_a_prompt_found_whole_still_computes_its_last_token() -> None:
    s = make(prefix_caching=True)
    s.add(prompt("a", list(range(1, 9))))
    drain(s)
    again = prompt("again", list(range(1, 9)), arrival=1)
    s.add(again)
    out = s.schedule()
    assert out is not None and (out.prefills[0].start, out.prefills[0].length) == (4, 4)
    s.update(out, {"again": (5, None)})
    drain(s)


def test_requests_sharing_a_prefix_share_its_blocks_and_free_them_once_each() -> None:
    s = make(prefix_caching=True, blocks=16, max_batch_tokens=100)
    s.add(prompt("a", list(range(1, 14))))
    run_step(s)  # prefilled, decoding: its three full blocks registered
    b, c = prompt("b", [*range(1, 13), 50], arrival=1), \
        prompt("c", [*range(1, 13), 60, 61], arrival=2)
    s.add(b)
    s.add(c)
    out = run_step(s)
    assert out is not None and [ch.start for ch in out.prefills] == [12, 12]
    a = s.get("a")
    assert a is not None
    assert a.block_table[:3] == b.block_table[:3] == c.block_table[:3]
    drain(s)
    assert s.blocks.num_free == 16 and not s.has_work


def test_a_prompt_to_score_and_a_pool_without_caching_compute_every_token() -> None:
    s = make(prefix_caching=True)
    s.add(prompt("a", list(range(1, 14))))
    drain(s)
    scored = prompt("scored", list(range(1, 14)), arrival=1, prompt_logprobs=True)
    s.add(scored)
    out = s.schedule()
    assert out is not None and out.prefills[0].start == 0 and scored.cached_tokens == 0
    off = make()
    off.add(prompt("a", list(range(1, 14))))
    drain(off)
    assert off.blocks.num_cached == 0
    off.add(prompt("b", list(range(1, 14)), arrival=1))
    out = off.schedule()
    assert out is not None and out.prefills[0].start == 0
    assert (off.prefix_queried, off.prefix_hits) == (0, 0)


def test_the_prefill_role_finds_what_it_handed_on_and_the_pool_takes_it_back() -> None:
    s = make(Role.PREFILL, prefix_caching=True, blocks=6, watermark_blocks=0)
    a = prompt("a", list(range(1, 13)))
    s.add(a)
    run_step(s)
    assert a.status is RequestStatus.PARKED
    s.release("a")  # pulled: its blocks stay cached, free
    assert s.blocks.num_free == 6 and s.blocks.num_cached == 3
    b = prompt("b", [*range(1, 13), 9], arrival=1)
    s.add(b)
    out = run_step(s)
    assert out is not None and out.prefills[0].start == 12 and b.cached_tokens == 12
    s.release("b")
    # a prompt of 24 tokens needs all 6 blocks: the cached ones are taken for it
    c = prompt("c", list(range(200, 224)), arrival=2)
    s.add(c)
    out = run_step(s)
    assert out is not None and out.prefills[0].start == 0 and len(c.block_table) == 6
    assert s.blocks.num_cached == 0
    s.release("c")
    assert s.blocks.num_free == 6


def test_requests_of_other_salts_share_no_cached_block() -> None:
    s = make(prefix_caching=True)
    s.add(prompt("a", list(range(1, 14)), cache_salt="tenant-a"))
    drain(s)
    for rid, salt, start in (("b", "tenant-b", 0), ("plain", "", 0), ("a2", "tenant-a", 12)):
        s.add(prompt(rid, list(range(1, 14)), arrival=1, cache_salt=salt))
        out = s.schedule()
        assert out is not None and out.prefills[0].start == start, rid
        s.update(out, {rid: (5, None)})
        drain(s)
