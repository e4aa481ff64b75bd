"""A rank's own KV listener: a rank other than 0 of a prefill instance serves the part of each
parked request's KV that it holds (its layers, its KV heads) over UCX, from a thread of its
own while it runs steps, so a decode rank pulls its part from the ranks that hold it and no
byte of the KV passes through rank 0.

Rank 0 tells the rank which requests are parked on which blocks (`ParkedBlocks`, by the PARK
and UNPARK commands: in order with the steps, so a request's blocks leave the table before a
step may write them again) and the key of its tokens; the rank tells rank 0 its address and
what it served through the instance's store (`address_key`, `SERVED_BYTES`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

import torch

from shared.engine.kv_cache import KVCache
from shared.engine.parallel.sharding import KvSpan

log = logging.getLogger(__name__)

# how long a pull waits for rank 0's PARK of its request: the decode instance hears of the
# request only after rank 0 sent it, but the rank may still be reading the command
PARK_WAIT_S = 5.0
SERVED_BYTES, SERVED_REQUESTS = "kv/served_bytes", "kv/served_requests"


def address_key(rank: int) -> str:
    """The store key rank `rank` sets to its KV listener's address (or "error: ...")."""
    return f"kv/address/{rank}"


class ParkedBlocks:
    """The requests whose KV a rank may serve, and their blocks (thread-safe): the step
    thread parks and unparks, the listener's threads read under `holding`, so an unpark
    waits for a copy in progress to end."""

    def __init__(self) -> None:
        self._blocks: dict[str, list[int]] = {}
        self._changed = threading.Condition()

    def park(self, request_id: str, blocks: list[int]) -> None:
        with self._changed:
            self._blocks[request_id] = blocks
            self._changed.notify_all()

    def unpark(self, request_id: str) -> None:
        with self._changed:
            self._blocks.pop(request_id, None)

    @contextlib.contextmanager
    def holding(self, request_id: str, wait_s: float = PARK_WAIT_S
                ) -> Iterator[list[int] | None]:
        """The request's blocks, parked while the block lasts (None: not parked within
        `wait_s`)."""
        with self._changed:
            self._changed.wait_for(lambda: request_id in self._blocks, timeout=wait_s)
            yield self._blocks.get(request_id)

    def __len__(self) -> int:
        with self._changed:
            return len(self._blocks)


def export_part(kv: KVCache, blocks: list[int], span: KvSpan, part: KvSpan | None
                ) -> torch.Tensor | None:
    """`part` (None: all the rank holds) of the blocks of a pool that holds `span`, as one
    contiguous tensor; None if the rank does not hold all of `part`."""
    if part is None:
        return kv.export_blocks(blocks)
    if part.overlap(span) != part:
        return None
    layers, heads = part.within(span)
    return kv.export_blocks(blocks, layers, heads)


class RankKvServer:
    """A KvServer on a thread of its own (its event loop), serving `kv`'s parked blocks."""

    def __init__(self, kv: KVCache, span: KvSpan, store: Any) -> None:
        self.kv, self.span, self.store = kv, span, store
        self.parked = ParkedBlocks()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kv-listener",
                                        daemon=True)
        self._server: Any = None

    def start(self, host: str, key: bytes) -> str:
        """Listen on `host` (the instance's), with rank 0's key; the address."""
        from shared import kv_transfer  # UCX starts in a rank only where it serves KV

        kv_transfer.enable_notifier_thread()
        self._server = kv_transfer.KvServer(lookup=self._lookup, host=host, key=key,
                                            on_served=self._served)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(timeout=60)
        return str(self._server.address)

    async def _listen(self) -> None:
        self._server.start()

    async def _lookup(self, request_id: str, part: KvSpan | None) -> Any:
        return await asyncio.to_thread(self._export, request_id, part)

    def _export(self, request_id: str, part: KvSpan | None) -> Any:
        with self.parked.holding(request_id) as blocks:
            if blocks is None:
                return None
            buffer = export_part(self.kv, blocks, self.span, part)
        return None if buffer is None else buffer.numpy()

    def _served(self, nbytes: int) -> None:
        self.store.add(SERVED_BYTES, nbytes)
        self.store.add(SERVED_REQUESTS, 1)

    def stop(self) -> None:
        """Close the listener and UCX's notifier thread (not a daemon: the process would not
        exit while it runs)."""
        if self._server is None:
            return
        from shared import kv_transfer

        async def close() -> None:
            self._server.close()
            kv_transfer.stop_notifier_thread()

        with contextlib.suppress(Exception):  # stopping anyway
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
