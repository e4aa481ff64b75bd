"""The ranks of one parallel instance (pp stages of tp ranks). Rank 0 (the engine's process)
starts the other ranks as processes of their own, joins them in a process group of their own
(gloo, on the CPU: GPUs and NCCL are not built yet; never torch's global default group, so
several instances live in one process), each stage's tp ranks in a group of theirs for the
all-reduces, and drives them by commands: a step's inputs, a KV export or import, stop.
Commands travel on a group of their own, sent without waiting (rank 0 runs its own stage of
a step while the other stages still run the steps before it: a pipeline's micro-batches)
and awaited by a rank for as long as the instance stays idle; a step's hand-offs and
all-reduces wait at most `collective_timeout()`.

A rank that dies fails the instance, never hangs it: a collective on a closed connection
raises at once, and `RankFailed` ends the engine's loop (the service exits and its requests
fail over). Ranks die with rank 0 (the parent-death signal)."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import ctypes
import enum
import json
import logging
import os
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from pydantic import TypeAdapter
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from shared.engine.config import EngineConfig
from shared.engine.parallel.layout import RankPlace

if TYPE_CHECKING:
    from shared.engine.parallel.kv_serving import KvPull, PullsUnderWay

log = logging.getLogger(__name__)

# how long a rank waits for rank 0's next command: the instance may be idle for any time
IDLE = timedelta(days=365)
POLL_S = 0.5  # rank 0 checks its ranks' processes this often while it waits for them
CONFIG = TypeAdapter(EngineConfig)


def collective_timeout() -> timedelta:
    """How long a step's collective or hand-off waits for a rank that neither answers nor
    dies (a rank still loading its weights answers the first one late):
    DS_COLLECTIVE_TIMEOUT_S, 600 s by default."""
    return timedelta(seconds=float(os.environ.get("DS_COLLECTIVE_TIMEOUT_S", "600")))


class RankFailed(RuntimeError):
    """A rank of the instance died or its collective failed: the instance cannot go on."""


class Command(enum.IntEnum):
    STOP = 0
    STEP = 1  # payload: the step's packed inputs (parallel.packet)
    EXPORT = 2  # payload: block ids; then each rank sends rank 0 its layers' K/V heads
    IMPORT = 3  # payload: block ids; then rank 0 sends each rank its layers' K/V heads
    SERVE_KV = 4  # payload: text, JSON {"host", "key"}: start a KV listener (kv_serving)
    PARKED = 5  # payload: text, JSON {"unpark": [ids], "park": {id: blocks}}: the requests
    # whose blocks are no longer theirs, and those whose KV may now be pulled (kv_serving)
    PULL_KV = 6  # payload: text, kv_serving.PullOrder list as JSON: pull their parts of the KV


@dataclass
class Collective:
    """One instance's process group, seen from rank `rank` of `size`. With `check`, a wait
    for a collective wakes every POLL_S to call it (it raises where a rank has died: a dead
    peer is not always seen by gloo's own connection at once). A send or receive is checked
    before it is waited for, then waited for whole: a gloo send or receive whose wait times
    out is abandoned (its connection closed), unlike a collective; a peer that dies during
    one closes the connection it waits on. Sends and receives between two ranks match in the
    order they were started."""

    group: Any  # a c10d Backend (gloo): its type stubs lack the collectives
    rank: int
    size: int
    timeout: timedelta  # the group's: how long a sliced wait goes on while every rank lives
    check: Callable[[], None] | None = None

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over the ranks, in place."""
        self.wait(self.group.allreduce([tensor]), sliced=True)

    def send(self, tensor: torch.Tensor, to: int) -> None:
        self.wait(self.start_send(tensor, to))

    def receive(self, tensor: torch.Tensor, source: int) -> None:
        """Rank `source`'s `send` into `tensor` (its shape and dtype)."""
        self.wait(self.start_receive(tensor, source))

    def start_send(self, tensor: torch.Tensor, to: int) -> Any:
        """A send under way (its Work): `tensor` must live until it completes."""
        return self.group.send([tensor], to, 0)

    def start_receive(self, tensor: torch.Tensor, source: int) -> Any:
        """A receive under way into `tensor` (its Work): it may be posted before the
        sender gets to its send."""
        return self.group.recv([tensor], source, 0)

    def wait(self, work: Any, sliced: bool = False) -> None:
        if self.check is None:
            work.wait()
            return
        if not sliced:
            self.check()
            work.wait()
            return
        deadline = time.monotonic() + self.timeout.total_seconds()
        while True:
            try:
                work.wait(timedelta(seconds=POLL_S))
                return
            except RuntimeError:
                if work.is_completed():
                    # failed (its error again), or done since the slice timed out: gloo's
                    # timed-out wait leaves the work as it was, and it may end meanwhile
                    work.wait()
                    return
                if time.monotonic() > deadline:  # still running: go on while every rank
                    raise  # lives, up to the group's timeout
                self.check()


class Outbox:
    """Sends a rank started and has not waited for, each with its tensor (which must live
    until it is sent): a stage hands its output on and goes on to its next command while the
    next stage still runs the micro-batch before. At most `keep` are held: a new send waits
    for the oldest beyond them (a gloo send counts as completed only once waited for), and
    `keep` is chosen so that it has been taken by then, or will be without this rank doing
    anything more. A send that failed raises when it is waited for."""

    def __init__(self, collective: Collective, keep: int) -> None:
        assert keep >= 1
        self.collective, self.keep = collective, keep
        self._pending: collections.deque[tuple[Any, torch.Tensor]] = collections.deque()

    def send(self, tensor: torch.Tensor, to: int) -> None:
        self._pending.append((self.collective.start_send(tensor, to), tensor))
        while len(self._pending) > self.keep:
            self.collective.wait(self._pending.popleft()[0])

    def settle(self) -> None:
        """Wait for every send under way."""
        while self._pending:
            self.collective.wait(self._pending.popleft()[0])


def connect(store: Store, rank: int, size: int, timeout: timedelta | None = None
            ) -> Collective:
    timeout = timeout or collective_timeout()
    return Collective(dist.ProcessGroupGloo(store, rank, size, timeout), rank, size, timeout)


def connect_commands(store: Store, rank: int, size: int) -> Collective:
    """The instance's group for rank 0's commands: a rank waits on it for as long as the
    instance stays idle."""
    return connect(PrefixStore("commands", store), rank, size, IDLE)


def connect_acks(store: Store, rank: int, size: int) -> Collective:
    """The instance's group for the ranks' answers to rank 0's KV pulls (kv_serving): rank 0
    waits on it for as long as the instance stays idle."""
    return connect(PrefixStore("acks", store), rank, size, IDLE)


def connect_stage(store: Store, instance: Collective, place: RankPlace) -> Collective:
    """The group of `place`'s stage (its tp ranks), for the all-reduces: the instance's own
    group where there is one stage."""
    if place.pp == 1:
        return instance
    return connect(PrefixStore(f"stage{place.stage}", store), place.tp_rank, place.tp)


def rank_threads(config: EngineConfig, cores: int | None = None) -> int:
    """Torch threads a rank takes on the CPU: its share of the instance's `threads` as
    given; by default (threads 0) its share of the `cores` the process may run on, less one
    where that share is 4 or more, so the ranks leave a core a rank to their collectives
    (where it is less, a thread is too large a part of the rank's). Gloo runs each
    all-reduce in I/O threads of its own, which otherwise wait for a core: on a 16-core
    Xeon, tp 4 at 4 threads a rank spent 125-135 ms of a 199 ms batch-1 decode step in
    all-reduces, at 3 threads a rank 27 ms of 99 ms, its prefill as fast
    (docs/benchmarks.md)."""
    if config.threads:
        return max(1, config.threads // config.ranks)
    cores = cores or len(os.sched_getaffinity(0))
    share = max(1, cores // config.ranks)
    return share - 1 if config.ranks > 1 and share >= 4 else share


def send_command(outbox: Outbox, command: Command, payload: torch.Tensor) -> None:
    """Rank 0: a command (and its payload of int64) to every other rank, without waiting."""
    header = torch.tensor([int(command), payload.numel()])
    for rank in range(1, outbox.collective.size):
        outbox.send(header, rank)
        if payload.numel():
            outbox.send(payload, rank)


def text_payload(text: str) -> torch.Tensor:
    """`text` as a command's payload (its UTF-8 bytes, one an element)."""
    return torch.tensor(list(text.encode()), dtype=torch.long)


def payload_text(payload: torch.Tensor) -> str:
    return bytes(payload.tolist()).decode()


def receive(commands: Collective) -> tuple[Command, torch.Tensor]:
    """A rank's next command from rank 0 and its payload."""
    header = torch.empty(2, dtype=torch.long)
    commands.receive(header, 0)
    command, length = Command(int(header[0])), int(header[1])
    payload = torch.empty(length, dtype=torch.long)
    if length:
        commands.receive(payload, 0)
    return command, payload


class Ranks:
    """Rank 0's handle on the other ranks of its instance: their processes and the group."""

    def __init__(self, config: EngineConfig) -> None:
        size = config.ranks
        self.places = [RankPlace(rank, config.tp, config.pp) for rank in range(size)]
        store = TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                         timeout=collective_timeout())
        blob = CONFIG.dump_json(config).decode()
        self.processes = [subprocess.Popen(
            [sys.executable, "-m", "shared.engine.parallel.rank", "--rank", str(rank),
             "--port", str(store.port), "--parent", str(os.getpid()), "--config", blob])
            for rank in range(1, size)]
        self._finalizer = weakref.finalize(self, _kill, self.processes)
        self.failed = False  # a collective failed: the ranks are out of step, not stopped
        try:
            self._wait_joined(store)
            self.collective = connect(store, 0, size)
            self.collective.check = self.check
            self.stage = connect_stage(store, self.collective, self.places[0])
            self.stage.check = self.check
            self.commands = connect_commands(store, 0, size)
            self.commands.check = self.check
            self.acks = connect_acks(store, 0, size)
        except RuntimeError as e:
            self.failed = True
            self.close()
            raise RankFailed(f"the {size} ranks of an instance did not connect: {e}") from e
        self.store = store  # rank 0 hosts it: kept for the group's life
        # a command's sends (a header and a payload a rank) and rank 0's stage outputs (one a
        # step), kept for the steps that may be under way and one more: the ones beyond
        # belong to steps finished (their output came back through every stage) or to
        # exports and imports done, so the wait for them returns at once
        self.outbox = Outbox(self.commands, 2 * (size - 1) * (config.pp + 1))
        self.hand_offs = Outbox(self.collective, config.pp + 1)
        self.pulls: PullsUnderWay | None = None  # the ranks' KV pulls, from the first
        self.reduce_s = 0.0  # rank 0's seconds in all-reduces (waiting for the slowest rank
        self.reduces = 0  # included), and how many: the share of a step they take

    def command(self, command: Command, payload: torch.Tensor | None = None) -> None:
        payload = torch.empty(0, dtype=torch.long) if payload is None else payload
        with self._guarded():
            self.check()
            send_command(self.outbox, command, payload)

    def serve_kv(self, host: str, key: bytes) -> list[str]:
        """Start each other rank's KV listener (kv_serving) on `host`, with the key of rank
        0's tokens: their addresses, rank 1 first."""
        from shared.engine.parallel.kv_serving import address_key

        self.command(Command.SERVE_KV, text_payload(json.dumps({"host": host,
                                                                "key": key.hex()})))
        keys = [address_key(rank) for rank in range(1, len(self.places))]
        self._wait_for(self.store, keys, collective_timeout().total_seconds())
        addresses = [self.store.get(k).decode() for k in keys]
        failed = [a for a in addresses if a.startswith("error")]
        if failed:
            raise RuntimeError(f"a rank's KV listener did not start: {failed[0]}")
        return addresses

    def pull_kv(self, pulls: list[KvPull], timeout_s: float
                ) -> list[concurrent.futures.Future[bool]]:
        """Have each other rank pull its part of each request's KV from the pull's sources
        (the prefill instance's listeners and the parts they hold) into its blocks, within
        `timeout_s` from now (one command for all): a future a pull, True once every rank's
        part is in its pool, False if one's pull failed or ran out of time (RankFailed if a
        rank died). No rank writes the blocks once it resolves; they must stay allocated
        until then."""
        from shared.engine.parallel.kv_serving import ORDERS, PullOrder, PullsUnderWay

        if self.pulls is None:
            self.pulls = PullsUnderWay(self.acks)
        deadline = time.time() + timeout_s
        expected = [self.pulls.expect() for _ in pulls]
        orders = [PullOrder.of(seq, pull, deadline)
                  for (seq, _), pull in zip(expected, pulls, strict=True)]
        try:
            self.command(Command.PULL_KV, text_payload(ORDERS.dump_json(orders).decode()))
        except BaseException:
            for seq, _ in expected:
                self.pulls.forget(seq)
            raise
        return [future for _, future in expected]

    def kv_moved(self) -> tuple[int, int]:
        """Pulls the other ranks served or made (kv_serving), and their bytes."""
        from shared.engine.parallel.kv_serving import MOVED_BYTES, MOVED_REQUESTS

        return self.store.add(MOVED_REQUESTS, 0), self.store.add(MOVED_BYTES, 0)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Over rank 0's stage."""
        started = time.perf_counter()
        with self._guarded():
            self.stage.all_reduce(tensor)
        self.reduce_s += time.perf_counter() - started
        self.reduces += 1

    def send(self, tensor: torch.Tensor, to: int) -> None:
        with self._guarded():
            self.collective.send(tensor, to)

    def receive(self, tensor: torch.Tensor, source: int) -> None:
        with self._guarded():
            self.collective.receive(tensor, source)

    def hand_on(self, tensor: torch.Tensor, to: int) -> None:
        """Send `tensor` without waiting for rank `to` to take it."""
        with self._guarded():
            self.hand_offs.send(tensor, to)

    def start_receive(self, tensor: torch.Tensor, source: int) -> Any:
        """A receive posted now, waited for by `wait`."""
        with self._guarded():
            return self.collective.start_receive(tensor, source)

    def wait(self, work: Any) -> None:
        with self._guarded():
            self.collective.wait(work)

    def _wait_joined(self, store: Store) -> None:
        """Until every rank has said it is up (`joined`)."""
        self._wait_for(store, [joined_key(rank) for rank in range(1, len(self.places))])

    def _wait_for(self, store: Store, keys: list[str], timeout_s: float | None = None
                  ) -> None:
        """Until the ranks have set `keys`, polling their processes: one that exits first
        fails the instance now, not at a timeout (RankFailed after `timeout_s` too)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not store.check(keys):
            self.check()
            if deadline is not None and time.monotonic() > deadline:
                raise RankFailed(f"the ranks did not set {keys} in {timeout_s:.0f} s")
            time.sleep(0.05)

    def check(self) -> None:
        """RankFailed if a rank's process has exited."""
        dead = self._dead()
        if dead:
            raise RankFailed(dead)

    def _dead_after_reset(self, grace_s: float = 2.0) -> str:
        """The ranks that exited, given a moment: a killed rank's connections reset before
        its exit status can be read."""
        deadline = time.monotonic() + grace_s
        while not self._dead() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self._dead()

    def _dead(self) -> str:
        return ", ".join(f"rank {rank} exited with {p.poll()}"
                         for rank, p in enumerate(self.processes, start=1)
                         if p.poll() is not None)

    @contextlib.contextmanager
    def _guarded(self) -> Iterator[None]:
        """A failed collective as RankFailed, naming the ranks that exited."""
        try:
            yield
        except RankFailed:
            self.failed = True
            raise
        except RuntimeError as e:
            self.failed = True
            raise RankFailed(f"{self._dead_after_reset() or 'a collective failed'}: {e}") from e

    def close(self) -> None:
        """Stop the ranks: a STOP each will read (unless a collective failed: they may be
        waiting in another), then a kill for any still running."""
        if not self.failed and all(p.poll() is None for p in self.processes):
            with contextlib.suppress(RankFailed):  # one is gone: the rest are killed below
                self.command(Command.STOP)
            for process in self.processes:
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    log.warning("rank process %d did not stop: killing it", process.pid)
        self._finalizer()


def _kill(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()


def joined_key(rank: int) -> str:
    """The store key rank `rank` sets once it runs, before the process group forms."""
    return f"joined/{rank}"


def die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this process when its parent dies (a killed rank 0 leaves no ranks)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)
