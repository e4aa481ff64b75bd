"""Each rank moves its own part of the KV (its layers, its KV heads) over UCX, from a thread of
its own while it runs steps: a rank of a prefill instance serves it, a rank of a decode
instance pulls it from the prefill ranks that hold it, so no byte of the KV passes through
rank 0 nor waits behind a step.

Prefill: rank 0 tells the rank which requests are parked on which blocks (`ParkedBlocks`, by
the PARKED command: in order with the steps, so a request's blocks leave the table before a
step may write them again) and the key of its tokens; the rank tells rank 0 its address and
what it moved through the instance's store (`address_key`, `MOVED_BYTES`).

Decode: rank 0 allocates the blocks and sends each rank a `PullOrder` (PULL_KV) with a
deadline; each rank answers on a group of its own once its part is in its pool, or once its
pull failed or ran out of time (`PullsUnderWay`): after its answer it writes nothing more
into those blocks. Rank 0 admits the request when every rank has answered, and frees the
blocks of a failed pull only then."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from pydantic import TypeAdapter

from shared.engine.kv_cache import Alloc, KVCache, Staging
from shared.engine.parallel.group import Collective, RankFailed
from shared.engine.parallel.layout import KvSpan

T = TypeVar("T")

log = logging.getLogger(__name__)

# how long a pull waits for rank 0's PARKED naming its request: the decode instance hears of
# the request only once rank 0 has sent it, but a pipeline's rank may still be running the
# stages of the micro-batches launched before (seconds each, for long prompts). The puller's
# own timeout gives up sooner where it is shorter.
PARK_WAIT_S = 60.0
PARK_POLL_S = 0.005
MOVED_BYTES, MOVED_REQUESTS = "kv/bytes", "kv/requests"  # served or pulled, all ranks


def address_key(rank: int) -> str:
    """The store key rank `rank` sets to its KV listener's address (or "error: ...")."""
    return f"kv/address/{rank}"


class ParkedBlocks:
    """The requests whose KV a rank may serve, and their blocks (thread-safe): the step
    thread parks and unparks, the listener's threads read under `holding`, so an unpark
    waits for a copy in progress to end. It remembers the last `remember` requests unparked,
    so a pull of one is refused at once rather than after waiting for a park."""

    def __init__(self, remember: int = 4096) -> None:
        self._blocks: dict[str, list[int]] = {}
        self._gone: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._remember = remember
        self._lock = threading.Lock()

    def update(self, unpark: list[str], park: dict[str, list[int]]) -> None:
        with self._lock:
            for request_id in unpark:
                self._blocks.pop(request_id, None)
                self._gone[request_id] = None
                self._gone.move_to_end(request_id)
            for request_id in park:
                self._gone.pop(request_id, None)
            self._blocks.update(park)
            while len(self._gone) > self._remember:
                self._gone.popitem(last=False)

    def __contains__(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._blocks

    def settled(self, request_id: str) -> bool:
        """Parked, or unparked lately: no need to wait for a park."""
        with self._lock:
            return request_id in self._blocks or request_id in self._gone

    @contextlib.contextmanager
    def holding(self, request_id: str) -> Iterator[list[int] | None]:
        """The request's blocks (None: not parked), parked while the block lasts."""
        with self._lock:
            yield self._blocks.get(request_id)

    def __len__(self) -> int:
        with self._lock:
            return len(self._blocks)


def export_part(kv: KVCache, blocks: list[int], span: KvSpan, part: KvSpan | None,
                alloc: Alloc | None = None, skip: int = 0) -> torch.Tensor | None:
    """`part` (None: all the rank holds) of the blocks but the first `skip` (the puller
    holds those already), of a pool that holds `span`, as one contiguous tensor (in room
    `alloc` gives); None if the rank does not hold all of `part`, or no block is left."""
    if not 0 <= skip < len(blocks):
        return None
    blocks = blocks[skip:]
    if part is None:
        return kv.export_blocks(blocks, alloc=alloc)
    if part.overlap(span) != part:
        return None
    layers, heads = part.within(span)
    return kv.export_blocks(blocks, layers, heads, alloc)


@dataclass(frozen=True)
class KvPull:
    """A request's KV to pull into `blocks`: from the prefill instance's listeners, each
    with the part of the KV it holds, showing `token`."""

    request_id: str
    token: str
    blocks: list[int]
    sources: list[tuple[str, KvSpan]]
    skip: int = 0  # the request's leading blocks not pulled (held here already): `blocks`
    # are those after them


@dataclass
class PullOrder:
    """Rank 0's PULL_KV, one a request: pull the rank's part before `deadline` (seconds since
    the epoch: the instance's processes share the host's clock)."""

    seq: int
    request_id: str
    token: str
    blocks: list[int]
    sources: list[tuple[str, int, int, int, int]]  # address, layers, KV heads (ends exclusive)
    deadline: float
    skip: int = 0

    @classmethod
    def of(cls, seq: int, pull: KvPull, deadline: float) -> PullOrder:
        return cls(seq, pull.request_id, pull.token, pull.blocks,
                   [(a, s.layers.start, s.layers.stop, s.heads.start, s.heads.stop)
                    for a, s in pull.sources], deadline, pull.skip)

    def spans(self) -> list[tuple[str, KvSpan]]:
        return [(a, KvSpan(range(l0, l1), range(h0, h1))) for a, l0, l1, h0, h1 in self.sources]


ORDERS = TypeAdapter(list[PullOrder])


class RankKv:
    """A rank's KV transfers, on a thread of its own (its event loop, started with the first
    transfer): on a prefill instance a KvServer serving `kv`'s parked blocks; on a decode
    instance a KvClient pulling the rank's part of requests' KV into its pool, each pull
    answered to rank 0 on the `acks` group. On the CPU both sides stage the part in host
    buffers reused transfer after transfer (`Staging`, as rank 0's service does: a buffer
    touched first pays for every page)."""

    def __init__(self, kv: KVCache, span: KvSpan, store: Any, acks: Collective) -> None:
        self.kv, self.span, self.store, self.acks = kv, span, store, acks
        self.parked = ParkedBlocks()
        self.staging = Staging.for_pool(kv)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kv-transfers",
                                        daemon=True)
        self._server: Any = None
        self._client: Any = None

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if not self._thread.is_alive():
            from shared import kv_transfer  # UCX starts in a rank only where it moves KV

            kv_transfer.enable_notifier_thread()
            self._thread.start()
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def serve(self, host: str, key: bytes) -> str:
        """Listen on `host` (the instance's), with rank 0's key; the address."""
        from shared import kv_transfer

        self._server = kv_transfer.KvServer(lookup=self._lookup, host=host, key=key,
                                            on_served=lambda served: self._moved(1, served.nbytes),
                                            sent=self._sent)
        self._run(self._listen()).result(timeout=60)
        return str(self._server.address)

    async def _listen(self) -> None:
        self._server.start()

    async def _lookup(self, request_id: str, part: KvSpan | None, skip: int) -> Any:
        """The part, once rank 0 has said the request is parked (waiting on this loop, not
        on a thread, for as long as PARK_WAIT_S); the copy on a thread of its own."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + PARK_WAIT_S
        while not self.parked.settled(request_id) and loop.time() < deadline:
            await asyncio.sleep(PARK_POLL_S)
        return await asyncio.to_thread(self._export, request_id, part, skip)

    def _export(self, request_id: str, part: KvSpan | None, skip: int) -> Any:
        from shared import kv_transfer

        with self.parked.holding(request_id) as blocks:
            if blocks is None:
                return None
            buffer = export_part(self.kv, blocks, self.span, part,
                                 None if self.staging is None else self.staging.take, skip)
        return None if buffer is None else kv_transfer.wire(buffer)

    def _sent(self, sent: Any) -> None:
        """An export UCX is done with: its staging buffer (what a CPU buffer's bytes are a
        view of) serves the next one."""
        from shared import kv_transfer

        if self.staging is not None and (lent := kv_transfer.unwire(sent)) is not None:
            self.staging.give(lent)

    def _moved(self, pulls: int, nbytes: int) -> None:
        self.store.add(MOVED_BYTES, nbytes)
        self.store.add(MOVED_REQUESTS, pulls)

    def pull(self, orders: list[PullOrder]) -> None:
        """Start pulling the rank's part of requests' KV (rank 0's PULL_KV), without
        waiting: the command loop goes on with the steps meanwhile."""
        for order in orders:
            self._run(self._pull(order))

    async def _pull(self, order: PullOrder) -> None:
        """Pull, then place the part in the request's blocks: no step reads or writes them
        until rank 0 admits the request, which it does once every rank has answered. The
        answer goes to rank 0 whatever happens, and nothing is written into the blocks after
        it: a pull past its deadline is abandoned (UCX writes no more into its buffers)."""
        from shared import kv_transfer

        failed = 1
        try:
            if self._client is None:
                self._client = kv_transfer.KvClient(timeout_s=PARK_WAIT_S)
            buffer = self.kv.empty_blocks(
                len(order.blocks), None if self.staging is None else self.staging.take)
            async with asyncio.timeout(max(0.0, order.deadline - time.time())):
                pulls = await kv_transfer.pull_pieces(
                    self._client, order.request_id, order.token, order.spans(), self.span,
                    buffer, order.skip)
            self.kv.import_blocks(order.blocks, buffer)
            if self.staging is not None:  # in the pool: the next pull may land in it (not
                self.staging.give(buffer)  # one that failed: UCX may still write it)
            self._moved(pulls, buffer.nbytes)
            failed = 0
        except TimeoutError:
            log.warning("the pull of %s's KV ran out of time", order.request_id)
        except Exception:  # rank 0 gives the request up (and says why in its log)
            log.exception("the pull of %s's KV failed", order.request_id)
        finally:
            self.acks.send(torch.tensor([order.seq, failed]), 0)

    def stop(self) -> bool:
        """Close the listener and endpoints, and UCX's notifier thread (not a daemon: the
        process would not exit while it runs): whether that was done."""
        if not self._thread.is_alive():
            return True
        from shared import kv_transfer

        async def close() -> None:
            if self._server is not None:
                self._server.close()
            if self._client is not None:
                await self._client.close()
            kv_transfer.stop_notifier_thread()

        try:
            self._run(close()).result(timeout=10)
        except Exception:  # the loop is stuck: the caller ends the process anyway
            log.exception("the KV transfers did not stop")
            return False
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
        return True


class PullsUnderWay:
    """Rank 0's side of its ranks' pulls: each PULL_KV order gets a number, every other rank
    answers [number, failed] on the acks group once its part is in its pool (or its pull
    failed), and the pull's future resolves when all have: True if every part landed. A rank
    that dies fails every pull under way with RankFailed. One thread a rank receives its
    answers (started with the first pull). The futures cannot be cancelled: a waiter that
    gives up must not make the blocks look free while a rank may still write them."""

    def __init__(self, acks: Collective) -> None:
        self.acks = acks
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[concurrent.futures.Future[bool], set[int], list[int]]] = {}
        self._numbers = itertools.count()
        self._threads: list[threading.Thread] = []
        self._failed: str | None = None

    def expect(self) -> tuple[int, concurrent.futures.Future[bool]]:
        """A number for the next pull and its future."""
        if not self._threads:
            self._threads = [threading.Thread(target=self._receive, args=(rank,), daemon=True,
                                              name=f"kv-acks-{rank}")
                             for rank in range(1, self.acks.size)]
            for thread in self._threads:
                thread.start()
        future: concurrent.futures.Future[bool] = concurrent.futures.Future()
        future.set_running_or_notify_cancel()  # from here `cancel()` does nothing
        with self._lock:
            if self._failed is not None:
                raise RankFailed(self._failed)
            seq = next(self._numbers)
            self._pending[seq] = (future, set(range(1, self.acks.size)), [])
        return seq, future

    def forget(self, seq: int) -> None:
        """A pull whose command never went out."""
        with self._lock:
            self._pending.pop(seq, None)

    def _receive(self, rank: int) -> None:
        answer = torch.empty(2, dtype=torch.long)
        while True:
            try:
                self.acks.receive(answer, rank)
            except Exception as e:  # the rank is gone (its connection closed)
                self._fail(f"rank {rank} stopped answering KV pulls: {e}")
                return
            seq, failed = answer.tolist()
            with self._lock:
                entry = self._pending.get(seq)
                if entry is None:
                    continue
                future, waiting, failures = entry
                waiting.discard(rank)
                if failed:
                    failures.append(rank)
                if waiting:
                    continue
                del self._pending[seq]
            future.set_result(not failures)

    def _fail(self, why: str) -> None:
        with self._lock:
            self._failed = why
            pending, self._pending = self._pending, {}
        for future, _, _ in pending.values():
            future.set_exception(RankFailed(why))
