"""KV-cache transfer over UCX (ucxx): the decode side pulls a request's blocks from the
prefill side. UCX picks the transport: shared memory or TCP on one host, CUDA IPC / NVLink
between GPUs of a node, RDMA across nodes; device buffers go as they are.

Protocol, per pull, on one endpoint the decode instance keeps per prefill instance:

    decode -> prefill   header: {"request_id": ..., "token": ..., "part": [l0, l1, h0, h1],
                                 "skip": k}
                        (HEADER_BYTES, JSON, padded; "part" and "skip" optional)
    prefill -> decode   header: {"ok": bool, "nbytes": n, "error": ...}
    prefill -> decode   payload: n bytes (the request's exported blocks), if ok

"skip": the request's first k blocks are not wanted (the decode instance holds that prefix
already, cached for an earlier request: prefix caching), so only the blocks after them cross.

A parallel instance's ranks each serve the part of the KV they hold (layers l0..l1, KV heads
h0..h1 of the model, ends exclusive), under one key: a decode rank asks each for the overlap
of its part and theirs (shared.engine.parallel.layout.kv_pieces), so every byte of the KV
crosses once and never through another rank.

A pull presents the request's token, which the prefill side handed only to the decode
instance the request was sent to (in its KvReady); a wrong token gets the same answer as an
unknown request. The prefill side looks the buffer up with a callback, so the engine stays
the owner of its memory; freeing the blocks afterwards is a separate control message (the
decode side tells the prefill instance over NATS once the pull has landed).

The listener's socket: ucxx (0.52) binds it to all interfaces and its Python API takes no
address, so the server restricts UCX to the network device that holds its address
(UCX_NET_DEVICES): a connection that arrives on another interface is rejected by UCX.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import struct
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import ucxx
import ucxx._lib_async.application_context as ucxx_connect
import ucxx._lib_async.continuous_ucx_progress as ucxx_progress
import ucxx._lib_async.listener as ucxx_listen
from ucxx._lib.arr import Array
from ucxx._lib_async.utils import hash64bits
from ucxx.exceptions import UCXCanceledError, UCXError

from shared.engine.parallel.layout import KvSpan, kv_pieces

log = logging.getLogger(__name__)


def enable_notifier_thread() -> None:
    """Await UCX requests on futures that ucxx's notifier thread completes, for a process
    with one event loop for its whole life (a service; call it before the first listener or
    endpoint). Otherwise ucxx waits by yielding to the event loop in a busy loop: a listener
    waiting for the next pull on an open endpoint burns a core for as long as the endpoint
    lives (it halved the prefill instance's speed on a 2-core host). The notifier thread is
    bound to the loop that is running when UCX starts, and is not a daemon: call
    `stop_notifier_thread` before the process exits."""
    os.environ.setdefault("UCXPY_ENABLE_PYTHON_FUTURE", "1")


def stop_notifier_thread() -> None:
    ucxx.stop_notifier_thread()


# Handshakes given up on: their buffers, which UCX may still write a late peer's answer into.
_HANDSHAKE_BUFFERS: list[Any] = []
_HANDSHAKE_FORMAT = "QQ"  # the endpoint's message tag, and its hash as a checksum


async def _exchange_peer_info(endpoint: Any, msg_tag: int, listener: bool,
                              connect_timeout: float = 5.0) -> dict[str, int]:
    """ucxx's endpoint handshake (the same bytes on the wire), safe to give up on. ucxx's own
    lets its receive buffer be freed when it times out or is cancelled while the receive is
    still posted: a peer frozen past the timeout (SIGSTOP, a long GC pause) that then
    answers writes into freed memory, and the process dies of heap corruption later
    (reproduced: a pull timing out on a frozen prefill instance crashed the decode instance
    once the prefill instance went on). Here a failed handshake closes its endpoint and
    keeps its buffers for the life of the process (a few hundred bytes a failed handshake:
    they happen only while a peer is frozen or gone)."""
    mine = struct.pack(_HANDSHAKE_FORMAT, msg_tag, hash64bits(msg_tag))
    theirs = bytearray(len(mine))
    send, recv = (endpoint.stream_send, Array(mine)), (endpoint.stream_recv, Array(theirs))
    try:  # the listener speaks first
        for step, array in [send, recv] if listener else [recv, send]:
            async with asyncio.timeout(connect_timeout):
                await step(array).wait()
        tag, checksum = struct.unpack(_HANDSHAKE_FORMAT, theirs)
        if checksum != hash64bits(tag):
            raise RuntimeError(f"UCX handshake: checksum {checksum:#x} does not match tag "
                               f"{tag:#x}")
    except BaseException:
        _HANDSHAKE_BUFFERS.append((mine, theirs, send[1], recv[1]))  # not the endpoint
        with contextlib.suppress(Exception):
            endpoint.close_blocking(period=10**9, max_attempts=1)
        raise
    return {"msg_tag": tag, "checksum": checksum}


ucxx_connect.exchange_peer_info = _exchange_peer_info
ucxx_listen.exchange_peer_info = _exchange_peer_info

# How long ucxx's progress thread sleeps in epoll_wait when no UCX event arrives. ucxx uses
# 1 ms: the thread then wakes 1,000 times a second for as long as the process lives, and on
# a host whose cores the engine threads keep busy each wakeup preempts an engine step
# (measured on 2 cores, a decode step next to a prefilling process: about 6% slower with
# the idle 1 ms thread in both processes, no slower with 100 ms). The timeout is only a
# safety net: UCX events, and requests handed to the thread (it is signalled), wake it at
# once, so pulls are as fast with 100 ms (measured, 4 KiB to 24 MB). DS_UCX_PROGRESS_TIMEOUT_MS
# overrides it (1: ucxx's own).
PROGRESS_EPOLL_TIMEOUT_MS = max(1, int(os.environ.get("DS_UCX_PROGRESS_TIMEOUT_MS", "100")))


class _ThreadMode(ucxx_progress.ProgressTask):  # type: ignore[misc]  # ucxx is untyped
    """ucxx's ThreadMode progress, with PROGRESS_EPOLL_TIMEOUT_MS in place of its 1 ms."""

    def __init__(self, worker: Any, event_loop: asyncio.AbstractEventLoop,
                 polling_mode: bool = False) -> None:
        super().__init__(worker, event_loop)
        worker.set_progress_thread_start_callback(ucxx_progress._create_context)
        worker.start_progress_thread(polling_mode=polling_mode,
                                     epoll_timeout=PROGRESS_EPOLL_TIMEOUT_MS)
        weakref.finalize(self, worker.stop_progress_thread)


ucxx_connect.ThreadMode = _ThreadMode

# UCX's TCP transport moves a message in segments of 8 KiB by default: a 5.9 MB KV (a
# 124-token SmolLM2 prompt) then crossed loopback in 4.9 ms (p50 of 25 pulls, two runs, a
# 2-vCPU Zen 5), a 23.6 MB one in 17-21 ms; with 256 KiB segments 1.7-3.0 ms and 9.0-9.2
# ms. UCX_TCP_TX_SEG_SIZE / UCX_TCP_RX_SEG_SIZE in the environment win.
UCX_OPTIONS = {"TCP_TX_SEG_SIZE": "256k", "TCP_RX_SEG_SIZE": "256k"}


def _start_ucx(**options: str) -> bool:
    """Start UCX in this process with UCX_OPTIONS and `options` (the environment's UCX_*
    variables take precedence), unless it has started already: whether it started now."""
    if ucxx.core._ctx is not None:
        return False
    ucxx.init(options={**UCX_OPTIONS, **options}, env_takes_precedence=True)
    return True


HEADER_BYTES = 512
SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address

# (request id, the part asked for or None for all the server holds, how many of its leading
# blocks to leave out) -> that part of the request's blocks after those, exported (a
# contiguous host or device array, complete when returned), or None
BlockLookup = Callable[[str, KvSpan | None, int], Awaitable[Any]]


class TransferError(RuntimeError):
    """The pull failed: unknown request, lease expired, or the peer went away."""


def _header(payload: dict[str, Any]) -> np.ndarray:
    raw = json.dumps(payload).encode()
    assert len(raw) <= HEADER_BYTES, "header too long"
    out = np.zeros(HEADER_BYTES, dtype=np.uint8)
    out[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    return out


def _parse(buf: np.ndarray) -> dict[str, Any]:
    return dict(json.loads(bytes(buf).rstrip(b"\0")))


def _span(part: Any) -> KvSpan | None:
    """A header's "part" as a span (ValueError if malformed)."""
    if part is None:
        return None
    l0, l1, h0, h1 = (int(x) for x in part)
    if not (0 <= l0 < l1 and 0 <= h0 < h1):
        raise ValueError(f"empty or negative part {part}")
    return KvSpan(range(l0, l1), range(h0, h1))


def wire(buffer: torch.Tensor) -> Any:
    """A contiguous tensor as UCX sends or receives it: its bytes (numpy's on the CPU, which
    has no bfloat16; the tensor itself on a GPU, as a byte array, so no dtype needs a
    typestr that an older torch lacks)."""
    raw = buffer.view(torch.uint8)
    return raw.numpy() if raw.device.type == "cpu" else raw


def unwire(wired: Any) -> torch.Tensor | None:
    """The tensor `wire` gave the bytes of (a view of it), or None for anything else."""
    if isinstance(wired, torch.Tensor):
        return wired
    base = getattr(wired, "base", None)
    return base if isinstance(base, torch.Tensor) else None


def interface_ipv4(interface: str) -> str | None:
    """The interface's (primary) IPv4 address, or None if it has none."""
    request = struct.pack("256s", interface.encode()[:15])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            reply = fcntl.ioctl(s.fileno(), SIOCGIFADDR, request)
        except OSError:  # the interface has no IPv4 address
            return None
    return socket.inet_ntoa(reply[20:24])


def net_device(host: str) -> str:
    """The network interface of this host whose (primary IPv4) address `host` names."""
    address = socket.gethostbyname(host)
    for _, interface in socket.if_nameindex():
        if interface_ipv4(interface) == address:
            return interface
    raise ValueError(f"the KV listener's address {host} ({address}) is on no network "
                     f"interface of this host: set DS_HOST to an address of this host")


@dataclass(frozen=True)
class Served:
    """One pull a KvServer answered: when it was asked (time.time()), when the blocks were
    ready to send (the lookup's copy out of the pool done) and when they were sent."""

    request_id: str
    nbytes: int
    asked: float
    found: float
    sent: float


@dataclass
class TransferStats:
    requests: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass
class KvServer:
    """Prefill side: serves exported blocks to the holder of each request's token."""

    lookup: BlockLookup
    host: str = "127.0.0.1"
    port: int = 0
    stats: TransferStats = field(default_factory=TransferStats)
    # the tokens' key: the ranks of one instance share it, so one token opens each rank
    key: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)
    on_served: Callable[[Served], None] | None = None  # each pull answered, once sent
    # what `lookup` returned, once UCX is done with it (sent, or its send failed; not where
    # the serving task was cancelled mid-send: UCX may still read it)
    sent: Callable[[Any], None] = lambda buffer: None
    _listener: Any = None

    def token(self, request_id: str) -> str:
        """The token that lets its holder pull request_id's blocks: 128 bits of an HMAC under
        a key this server alone keeps, so no table of tokens outlives the requests."""
        return hmac.new(self.key, request_id.encode(), hashlib.sha256).hexdigest()[:32]

    def start(self) -> None:
        """Start UCX on the network device of `host` only (UCX_NET_DEVICES, when set, wins:
        e.g. to add an RDMA device), then listen. UCX must not have started yet in this
        process."""
        if not _start_ucx(NET_DEVICES=net_device(self.host)):
            raise RuntimeError("UCX started in this process before its KV listener")
        self._listener = ucxx.create_listener(self._serve, port=self.port)
        self.port = self._listener.port

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def _serve(self, ep: Any) -> None:
        """Answer pulls on one endpoint until the peer hangs up (or gives up on a pull,
        aborting its endpoint) or speaks another protocol."""
        header = np.empty(HEADER_BYTES, dtype=np.uint8)
        with contextlib.suppress(UCXError, UCXCanceledError):
            while True:
                await ep.recv(header)
                try:
                    request = _parse(header)
                    part = _span(request.get("part"))
                    skip = int(request.get("skip", 0))
                except (ValueError, TypeError):  # not our protocol: hang up
                    break
                request_id = str(request.get("request_id", ""))
                asked = time.time()
                buffer = await self._find(request_id, str(request.get("token", "")), part,
                                          skip) if skip >= 0 else None
                if buffer is None:
                    await ep.send(_header({"ok": False, "error": f"no KV for {request_id}"}))
                    continue
                found, nbytes = time.time(), int(buffer.nbytes)
                try:
                    await ep.send(_header({"ok": True, "nbytes": nbytes}))
                    await ep.send(buffer)
                except (UCXError, UCXCanceledError):  # its request completed, failed
                    self.sent(buffer)
                    raise
                self.sent(buffer)
                self.stats.requests += 1
                self.stats.bytes += nbytes
                if self.on_served is not None:
                    self.on_served(Served(request_id, nbytes, asked, found, time.time()))
        with contextlib.suppress(UCXError, UCXCanceledError):
            await ep.close()

    async def _find(self, request_id: str, token: str, part: KvSpan | None, skip: int) -> Any:
        """The blocks, if the token is request_id's (checked before the engine is asked)."""
        if not hmac.compare_digest(self.token(request_id).encode(), token.encode()):
            return None
        return await self.lookup(request_id, part, skip)

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()


@dataclass
class KvClient:
    """Decode side: pulls blocks into a caller-provided buffer (host or device). A pull
    that takes longer than `timeout_s`, or is cancelled, is abandoned: its endpoint is
    aborted, so UCX writes nothing more into the buffer and no late reply pairs with the
    next pull's header. The next pull from that peer opens a new endpoint. (A slow peer is
    not shunned: its other requests' KV is still good, and failing them would only turn
    slowness into recomputation.)"""

    timeout_s: float = 10.0
    stats: TransferStats = field(default_factory=TransferStats)
    _endpoints: dict[str, Any] = field(default_factory=dict)
    _locks: dict[str, asyncio.Lock] = field(default_factory=dict)

    async def _endpoint(self, address: str) -> Any:
        ep = self._endpoints.get(address)
        if ep is not None and ep.closed:  # its peer hung up or died: open another
            self._abandon(address)
        if address not in self._endpoints:
            self._endpoints[address] = await self._open(address)
        return self._endpoints[address]

    async def _open(self, address: str) -> Any:
        _start_ucx()
        host, port = address.rsplit(":", 1)
        return await ucxx.create_endpoint(host, int(port),  # the pull's timeout
                                          connect_timeout=self.timeout_s)

    def connected(self, address: str) -> bool:
        """Whether an endpoint to `address` is open (not one its peer closed or failed)."""
        ep = self._endpoints.get(address)
        return ep is not None and not ep.closed

    async def connect(self, address: str) -> bool:
        """Open the endpoint to `address` ahead of its first pull, which otherwise waits for
        it (a first pull of 23.6 MB took 205 ms, 168 ms of it before the prefill side heard
        the ask, the next ones 21-41 ms; Zen 4): whether one is open now. Not under the
        address's lock: UCX gives up on a listener that is gone only at the timeout, and no
        pull waits for that; where a pull opened one meanwhile, or is opening one, this one
        is closed again."""
        if self.connected(address):
            return True
        try:
            async with asyncio.timeout(self.timeout_s):
                ep = await self._open(address)
        except (TimeoutError, UCXError, UCXCanceledError, OSError, ValueError, RuntimeError):
            return False
        lock = self._locks.get(address)
        if self.connected(address) or (lock is not None and lock.locked()):
            with contextlib.suppress(UCXError, UCXCanceledError, OSError):
                ep.abort()
            return self.connected(address)
        self._abandon(address)  # one its peer closed, if any
        self._endpoints[address] = ep
        return True

    def drop(self, address: str) -> None:
        """Close the endpoint to `address` (its peer left) unless a pull is using it."""
        lock = self._locks.get(address)
        if lock is None or not lock.locked():
            self._abandon(address)
            self._locks.pop(address, None)

    async def pull(self, address: str, request_id: str, token: str, into: Any,
                   part: KvSpan | None = None, skip: int = 0) -> None:
        """Fill `into` (exactly the size of the exported blocks, or of `part` of them, but
        the first `skip`) with request_id's KV, showing the token its KvReady carried."""
        lock = self._locks.setdefault(address, asyncio.Lock())
        loop = asyncio.get_running_loop()
        async with lock:  # one pull at a time per endpoint keeps header and payload paired
            start = loop.time()
            try:
                async with asyncio.timeout(self.timeout_s):
                    await self._transfer(address, request_id, token, into, part, skip)
            except TimeoutError:
                self._abandon(address)
                raise TransferError(f"pull of {request_id} from {address} took over "
                                    f"{self.timeout_s:.0f}s; abandoned") from None
            except asyncio.CancelledError:
                self._abandon(address)
                raise
            except (UCXError, UCXCanceledError, OSError) as e:  # a dead or absent peer
                self._abandon(address)
                raise TransferError(f"pull of {request_id} from {address} failed: {e}") from e
            self.stats.requests += 1
            self.stats.bytes += int(into.nbytes)
            self.stats.seconds += loop.time() - start

    async def _transfer(self, address: str, request_id: str, token: str, into: Any,
                        part: KvSpan | None, skip: int) -> None:
        ep = await self._endpoint(address)
        header: dict[str, Any] = {"request_id": request_id, "token": token}
        if part is not None:
            header["part"] = [part.layers.start, part.layers.stop, part.heads.start,
                              part.heads.stop]
        if skip:
            header["skip"] = skip
        await ep.send(_header(header))
        reply = np.empty(HEADER_BYTES, dtype=np.uint8)
        await ep.recv(reply)
        answer = _parse(reply)
        if not answer.get("ok"):
            raise TransferError(str(answer.get("error", "refused")))
        if int(answer["nbytes"]) != int(into.nbytes):  # its payload comes all the same:
            self._abandon(address)  # not to be read as the next pull's answer
            raise TransferError(f"size mismatch: {answer['nbytes']} bytes offered, "
                                f"{into.nbytes} expected")
        await ep.recv(into)

    def _abandon(self, address: str) -> None:
        """Drop the endpoint, cancelling what is in flight on it: a late reply must neither
        land in a buffer given up on nor pair with the next pull's header."""
        ep = self._endpoints.pop(address, None)
        if ep is not None:
            with contextlib.suppress(UCXError, UCXCanceledError, OSError):
                ep.abort()

    async def close(self) -> None:
        endpoints, self._endpoints = list(self._endpoints.values()), {}
        for ep in endpoints:  # a pull cancelled meanwhile may abandon its own: taken first
            with contextlib.suppress(UCXError, UCXCanceledError, OSError):
                await ep.close()


async def pull_pieces(client: KvClient, request_id: str, token: str,
                      sources: list[tuple[str, KvSpan]], wanted: KvSpan,
                      buffer: torch.Tensor, skip: int = 0) -> int:
    """Fill `buffer` (the part `wanted` of the request's blocks but its first `skip`: its
    layers, its KV heads) from the ranks of the prefill instance (their listeners and the
    parts they hold), from each the overlap, all at once: how many pulls it took. An overlap
    lands straight in `buffer` where its place there is contiguous (all of the heads), else
    in a buffer of its own first. One that fails abandons the others."""
    try:
        pieces = kv_pieces(wanted, [span for _, span in sources])
    except ValueError as e:
        raise TransferError(f"the prefill instance's KV is not this model's: {e}") from e
    targets = []
    for _, part in pieces:
        layers, heads = part.within(wanted)
        view = buffer[layers, :, :, :, heads]
        targets.append((view, view if view.is_contiguous() else torch.empty_like(
            view, memory_format=torch.contiguous_format)))
    if buffer.device.type == "cuda" and any(a is not b for a, b in targets):
        torch.cuda.current_stream(buffer.device).synchronize()  # before UCX writes them

    async def pull(address: str, part: KvSpan, view: torch.Tensor, into: torch.Tensor
                   ) -> None:
        await client.pull(address, request_id, token, wire(into), part, skip)
        if into is not view:
            view.copy_(into)

    tasks = [asyncio.create_task(pull(sources[i][0], part, view, into))
             for (i, part), (view, into) in zip(pieces, targets, strict=True)]
    try:
        await asyncio.gather(*tasks)
    finally:  # one failed: the others' transfers are abandoned, not left running
        for task in tasks:
            task.cancel()
    return len(tasks)
