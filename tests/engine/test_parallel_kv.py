"""Each rank moves its own part of the KV over UCX (real rank processes, real UCX): a prefill
instance's rank serves its layers of a parked request, or any part of them, to the holder of
the request's token and only while the request is parked; a decode instance's rank pulls its
part from the prefill rank that holds it, into the blocks rank 0 gave it, and the request
decodes to the tokens of one engine; a rank gives a pull up by its deadline, and a decode
rank that dies mid-pull fails the pull at once. How the parts fit together, the table of
parked blocks and the ranks' answers are pure and tested in milliseconds."""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import threading
import time

import pytest
import torch

from shared import kv_transfer
from shared.engine.config import LLAMA_SHAPES, EngineConfig, Role
from shared.engine.engine import Engine
from shared.engine.kv_cache import MIB, KVCache
from shared.engine.loader import LoadedModel
from shared.engine.parallel.group import RankFailed
from shared.engine.parallel.kv_serving import (
    KvPull,
    ParkedBlocks,
    PullOrder,
    PullsUnderWay,
    RankKv,
)
from shared.engine.parallel.layout import KvSpan, RankPlace, kv_pieces
from shared.engine.request import Request, SamplingParams
from shared.kv_transfer import KvClient, KvServer, TransferError
from tests.engine.conftest import NEW_TOKENS

GREEDY = SamplingParams(max_tokens=NEW_TOKENS)
KV = 32 << 20
CONFIG = LLAMA_SHAPES["tiny"]  # 2 layers, 2 KV heads


def spans(tp: int, pp: int, layers: int = 30, heads: int = 3) -> list[KvSpan]:
    config = dataclasses.replace(CONFIG, num_layers=layers, num_kv_heads=heads,
                                 num_heads=heads * 3)
    return [KvSpan.of(RankPlace(rank, tp, pp), config) for rank in range(tp * pp)]


# -- pure: the parts --------------------------------------------------------------------

def test_each_decode_rank_takes_its_part_from_the_prefill_ranks_that_hold_it() -> None:
    prefill = spans(tp=3, pp=1)  # a KV head each, every layer
    decode = spans(tp=1, pp=2)  # 15 layers each, every head
    for wanted in decode:
        pieces = kv_pieces(wanted, prefill)
        assert [i for i, _ in pieces] == [0, 1, 2]
        assert all(p.layers == wanted.layers and len(p.heads) == 1 for _, p in pieces)
    # every (layer, head) of the model moves exactly once, whatever the two grids
    for (ptp, ppp), (dtp, dpp) in [((3, 1), (1, 2)), ((1, 3), (3, 2)), ((3, 2), (1, 5))]:
        held = spans(ptp, ppp)
        cells = [(layer, head) for wanted in spans(dtp, dpp)
                 for _, part in kv_pieces(wanted, held)
                 for layer in part.layers for head in part.heads]
        assert sorted(cells) == [(layer, head) for layer in range(30) for head in range(3)]


def test_a_part_lies_within_its_buffer_and_ranks_that_do_not_cover_it_are_refused() -> None:
    outer = KvSpan(range(15, 30), range(0, 3))
    assert KvSpan(range(16, 18), range(1, 3)).within(outer) == (slice(1, 3), slice(1, 3))
    with pytest.raises(ValueError, match="does not cover"):
        kv_pieces(outer, spans(tp=3, pp=1, heads=3)[:2])  # a KV head short
    with pytest.raises(ValueError, match="does not cover"):
        kv_pieces(KvSpan(range(0, 30), range(0, 4)), spans(tp=3, pp=1))  # another model
    with pytest.raises(ValueError, match="does not cover"):  # as much, but twice over
        kv_pieces(KvSpan(range(0, 2), range(0, 2)), [KvSpan(range(0, 2), range(0, 1))] * 2)


def test_an_unpark_waits_for_a_copy_and_a_request_unparked_lately_is_refused_at_once() -> None:
    parked = ParkedBlocks()
    with parked.holding("r") as blocks:
        assert blocks is None
    parked.update([], {"r": [3, 4], "s": [5]})
    with parked.holding("r") as blocks:
        assert blocks == [3, 4]
        unparking = threading.Thread(target=parked.update, args=(["r"], {"t": [3]}))
        unparking.start()
        time.sleep(0.2)
        assert unparking.is_alive()  # not while the copy runs
    unparking.join(timeout=30)
    assert "r" not in parked and "t" in parked and "s" in parked
    assert parked.settled("r") and not parked.settled("u")  # unparked lately: refused at once
    parked.update([], {"r": [6]})  # a new attempt of the same request
    with parked.holding("r") as blocks:
        assert blocks == [6]
    remembering = ParkedBlocks(remember=2)
    remembering.update(["a", "b", "c"], {})
    assert [remembering.settled(r) for r in "abc"] == [False, True, True]


class Answers:
    """The acks group of a 3-rank instance, seen from rank 0: answers queued per rank."""

    size = 3

    def __init__(self) -> None:
        self.queues: dict[int, list[list[int] | None]] = {1: [], 2: []}
        self.ready = threading.Condition()

    def answer(self, rank: int, answer: list[int] | None) -> None:
        with self.ready:
            self.queues[rank].append(answer)
            self.ready.notify_all()

    def receive(self, tensor: torch.Tensor, source: int) -> None:
        with self.ready:
            self.ready.wait_for(lambda: bool(self.queues[source]))
            answer = self.queues[source].pop(0)
        if answer is None:
            raise RuntimeError("Connection closed by peer")
        tensor.copy_(torch.tensor(answer))


def test_a_pull_resolves_once_every_rank_has_answered_and_a_dead_rank_fails_the_rest() -> None:
    acks = Answers()
    pulls = PullsUnderWay(acks)  # type: ignore[arg-type]  # receive and size are all it uses
    first, landed = pulls.expect()
    second, failed = pulls.expect()
    acks.answer(2, [second, 1])  # out of order, and a failure
    acks.answer(1, [first, 0])
    assert not landed.done()
    acks.answer(2, [first, 0])
    assert landed.result(timeout=30) is True
    acks.answer(1, [second, 0])
    assert failed.result(timeout=30) is False
    _, orphan = pulls.expect()
    acks.answer(1, None)  # rank 1 dies
    with pytest.raises(RankFailed, match="rank 1"):
        orphan.result(timeout=30)
    with pytest.raises(RankFailed):
        pulls.expect()


# -- real ranks, real UCX -----------------------------------------------------------------

def pull(address: str, request_id: str, token: str, into: torch.Tensor,
         part: KvSpan | None = None, skip: int = 0) -> None:
    async def main() -> None:
        client = KvClient(timeout_s=30)
        try:
            await client.pull(address, request_id, token, into.numpy(), part, skip)
        finally:
            await client.close()

    asyncio.run(main())


class Sent:
    """Rank 0's acks group as a rank sees it: what it was sent."""

    def __init__(self) -> None:
        self.sent: list[list[int]] = []

    def send(self, tensor: torch.Tensor, rank: int) -> None:
        self.sent.append(tensor.tolist())


class Store:
    def add(self, key: str, amount: int) -> None:
        pass


def test_a_rank_lands_each_pull_in_a_reused_buffer_but_never_one_whose_pull_failed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode rank's pull lands in a staging buffer, given back once its part is in the
    pool; a failed pull's never (UCX may still write it): the pull after it lands in a
    new one. Every pull is answered, failed or not (the pull itself stands in: UCX's are in
    the slow test below)."""
    # a pool of 8 MiB keeps 2 MiB of buffers idle: one (each rounded up to a MiB)
    kv = KVCache.from_budget(CONFIG, 8 * MIB, 4, torch.float32, torch.device("cpu"))
    acks = Sent()
    rank = RankKv(kv, KvSpan.whole(CONFIG), Store(), acks)  # type: ignore[arg-type]
    rank._client = object()  # no UCX: the pull below stands in for it
    landed: list[int] = []

    async def pull_pieces(client: object, request_id: str, token: str, sources: object,
                          span: KvSpan, buffer: torch.Tensor, skip: int) -> int:
        assert skip == (request_id == "b")  # what the order said
        landed.append(buffer.data_ptr())
        if request_id == "fails":
            raise TransferError("the peer went away")
        buffer.fill_(float(len(landed)))
        return 1

    monkeypatch.setattr(kv_transfer, "pull_pieces", pull_pieces)

    def pull(seq: int, request_id: str, blocks: list[int], skip: int = 0) -> None:
        order = PullOrder(seq, request_id, "t", blocks, [], time.time() + 60, skip)
        asyncio.run(rank._pull(order))

    assert rank.staging is not None
    pull(0, "a", [3, 5])
    assert torch.equal(kv.export_blocks([3, 5]), torch.full_like(kv.export_blocks([3, 5]), 1))
    pull(1, "b", [7], skip=1)  # the same buffer, given back after the first pull's import
    pull(2, "fails", [1, 2, 4])  # ... and again, but not given back
    pull(3, "c", [6])
    assert landed[1] == landed[2] == landed[0] and landed[3] != landed[0]
    assert rank.staging.fresh == 2 and acks.sent == [[0, 0], [1, 0], [2, 1], [3, 0]]
    assert torch.equal(kv.export_blocks([6]), torch.full_like(kv.export_blocks([6]), 4))


@pytest.mark.slow
def test_each_rank_serves_and_pulls_its_own_part_of_the_kv(
        loaded: LoadedModel, prompt_ids: list[list[int]]) -> None:
    prompts = prompt_ids[:2]
    config = EngineConfig(kv_cache_bytes=KV)
    expected = [r.output_ids for r in Engine(config, loaded).generate(prompts, GREEDY)]
    two_stages = dataclasses.replace(config, pp=2)
    prefill = Engine(two_stages.with_scheduler(role=Role.PREFILL))
    decode = Engine(two_stages.with_scheduler(role=Role.DECODE))
    try:
        key = secrets.token_bytes(32)
        tokens = KvServer(lookup=None, key=key)  # type: ignore[arg-type]  # its tokens only
        [address] = prefill.serve_kv("127.0.0.1", key)  # rank 1's listener
        held = prefill.runner.kv_spans
        assert held == decode.runner.kv_spans and held[1].layers == range(15, 30)
        sources = [("127.0.0.1:9", held[0]), (address, held[1])]  # rank 0's: given here
        for i, ids in enumerate(prompts):
            prefill.add_request(f"m{i}", ids, GREEDY)
        while prefill.scheduler.waiting:
            prefill.step()
        moved, layers_bytes = [], 0
        for i, ids in enumerate(prompts):
            request_id, token = f"m{i}", tokens.token(f"m{i}")
            parked = prefill.scheduler.parked[request_id]
            reference = prefill.export_kv(request_id)  # every rank's, gathered by rank 0
            # rank 1 serves any part of what it holds to the token's holder
            part = KvSpan(range(16, 18), range(1, 3))
            got = torch.empty_like(reference[16:18, :, :, :, 1:3])
            pull(address, request_id, token, got, part)
            assert torch.equal(got, reference[16:18, :, :, :, 1:3])
            with pytest.raises(TransferError, match=f"no KV for {request_id}"):
                pull(address, request_id, tokens.token("another"), got, part)
            with pytest.raises(TransferError, match=f"no KV for {request_id}"):  # none left
                pull(address, request_id, token, got, part, skip=len(parked.block_table))
            # the decode instance's rank 1 pulls its layers itself; rank 0's part is given
            blocks = decode.allocate(len(ids))
            assert blocks is not None
            done = decode.pull_on_ranks([KvPull(request_id, token, blocks, sources)], 30)
            assert done is not None and done[0].result(timeout=120) is True
            own = prefill.export_part(request_id, held[0])
            assert own is not None
            decode.import_part(blocks, own)
            layers_bytes += reference[15:].nbytes
            request = Request(request_id, ids, GREEDY, eos_ids=decode.eos_ids,
                              output_ids=list(parked.output_ids))
            decode.admit_imported(request, blocks, None)
            moved.append(request)
        while decode.has_work():
            decode.step()
        assert [r.output_ids for r in moved] == expected
        assert decode.kv_moved_on_ranks()[1] == layers_bytes  # once, by the rank that holds it
        # a pull the prefill rank refuses fails on the decode rank, which tells rank 0
        blocks = decode.allocate(16)
        assert blocks is not None
        refused = decode.pull_on_ranks([KvPull("m0", "0" * 32, blocks, sources)], 30)
        assert refused is not None and refused[0].result(timeout=120) is False
        decode.free(blocks)
        # released, and the ranks told at the next step: no longer served
        whole = torch.empty_like(reference[15:])
        pull(address, "m1", tokens.token("m1"), whole)  # still parked
        prefill.release("m1")
        prefill.step()
        # the step sends the ranks their command without waiting: rank 1 may serve a pull
        # or two more before it reads it (a CI run's did), but not for long
        deadline = time.monotonic() + 60
        with pytest.raises(TransferError, match="no KV for m1"):
            while time.monotonic() < deadline:
                pull(address, "m1", tokens.token("m1"), whole)
                time.sleep(0.05)
        # a pull past its deadline (the prefill rank waits for a park of a request it has
        # not heard of) is given up by the rank by then
        blocks = decode.allocate(16)
        assert blocks is not None
        late = decode.pull_on_ranks([KvPull("m8", tokens.token("m8"), blocks, sources)], 2)
        assert late is not None and late[0].result(timeout=120) is False
        # a decode rank that dies mid-pull fails the pull with RankFailed at once, not at
        # its deadline, and cancelling the wait for it does not make its blocks look free
        pending = decode.pull_on_ranks([KvPull("m9", tokens.token("m9"), blocks, sources)],
                                       300)
        assert pending is not None and decode.runner.ranks is not None
        assert not pending[0].cancel()
        time.sleep(0.5)
        decode.runner.ranks.processes[0].kill()
        started = time.monotonic()
        with pytest.raises(RankFailed, match="rank 1"):
            pending[0].result(timeout=120)
        assert time.monotonic() - started < 60
    finally:
        prefill.close()
        decode.close()
