"""KV blocks exported from one process's pool arrive over UCX in another's, bit for bit, for
the holder of the request's token only, and through the listener's own address only."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing as mp
import os
import signal
import socket
from typing import Any

import numpy as np
import pytest
import torch

from shared.engine.config import LLAMA_SHAPES
from shared.engine.kv_cache import KVCache, Staging
from shared.engine.parallel.layout import KvSpan
from shared.kv_transfer import (
    KvClient,
    KvServer,
    TransferError,
    interface_ipv4,
    net_device,
    pull_pieces,
    stop_notifier_thread,
    unwire,
    wire,
)

CFG = LLAMA_SHAPES["tiny"]
SOURCE_BLOCKS = [5, 2, 9]


def pool(seed: int, dtype: torch.dtype = torch.float32) -> KVCache:
    kv = KVCache(CFG, 16, 4, dtype, torch.device("cpu"))
    kv.data.copy_(torch.randn(kv.data.shape, generator=torch.Generator().manual_seed(seed)))
    return kv


def serve(ports: Any, stop: Any, dtype: torch.dtype = torch.float32) -> None:
    """The prefill side, in its own process."""
    kv = pool(seed=1, dtype=dtype)
    exported = {"req-1": wire(kv.export_blocks(SOURCE_BLOCKS))}
    sent = []  # what the server said it was done sending

    async def lookup(request_id: str, part: Any, skip: int) -> Any:
        return exported.get(request_id)

    async def main() -> None:
        server = KvServer(lookup=lookup, sent=sent.append)
        server.start()
        ports.put((server.port, server.token("req-1"), server.token("req-unknown")))
        while not stop.is_set():
            await asyncio.sleep(0.05)
        # the bytes it counted, and how many of the lookups' buffers it gave back
        ports.put((server.stats.bytes, sum(b is exported["req-1"] for b in sent)))
        server.close()

    asyncio.run(main())


@pytest.fixture
def server_port(request: pytest.FixtureRequest) -> Any:
    dtype = getattr(request, "param", torch.float32)
    ctx = mp.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=serve, args=(ports, stop, dtype), daemon=True)
    proc.start()
    port, token, unknown_token = ports.get(timeout=120)
    yield port, token, unknown_token, ports, stop, proc.pid
    stop.set()
    proc.join(timeout=30)
    if proc.is_alive():
        proc.kill()


@pytest.mark.timeout(180)
def test_pull_moves_blocks_between_processes(server_port: Any) -> None:
    port, token, unknown_token, ports, stop, _ = server_port
    expected = pool(seed=1).export_blocks(SOURCE_BLOCKS)
    decode = pool(seed=2)
    target = [0, 11, 7]
    buffer = torch.empty_like(expected)

    async def main() -> None:
        client = KvClient()
        await client.pull(f"127.0.0.1:{port}", "req-1", token, buffer.numpy())
        with pytest.raises(TransferError, match="no KV for req-unknown"):
            await client.pull(f"127.0.0.1:{port}", "req-unknown", unknown_token,
                              buffer.numpy())
        assert client.stats.requests == 1 and client.stats.bytes == buffer.nbytes
        await client.close()

    asyncio.run(main())
    decode.import_blocks(target, buffer)
    assert torch.equal(decode.export_blocks(target), expected)
    stop.set()
    # the server counted what it sent, and gave the buffer back once sent
    assert ports.get(timeout=30) == (expected.nbytes, 1)


REQUESTS = {"req-a": [5, 2, 9], "req-b": [0, 15, 7, 3], "req-c": [11]}


def serve_staged(ports: Any, stop: Any) -> None:
    """The prefill side as the services run it on a CPU: each pull's blocks copied out of
    the pool into a staging buffer at the lookup, given back once UCX has sent it."""
    kv, staging = pool(seed=1), Staging()

    async def lookup(request_id: str, part: Any, skip: int) -> Any:
        blocks = REQUESTS.get(request_id, [])[skip:]
        return wire(kv.export_blocks(blocks, alloc=staging.take)) if blocks else None

    def sent(buffer: Any) -> None:
        lent = unwire(buffer)
        assert lent is not None
        staging.give(lent)

    async def main() -> None:
        server = KvServer(lookup=lookup, sent=sent)
        server.start()
        ports.put((server.port, {r: server.token(r) for r in REQUESTS}))
        while not stop.is_set():
            await asyncio.sleep(0.05)
        ports.put((server.stats.requests, staging.fresh, staging.idle_bytes > 0))
        server.close()

    asyncio.run(main())


@pytest.mark.timeout(180)
def test_staging_buffers_are_reused_pull_after_pull_over_ucx() -> None:
    """Both sides lend each transfer a staging buffer and take it back: pulls of requests
    of several sizes, one after another, each land bit for bit in a buffer that held the
    one before's bytes, and neither side allocated more than one buffer. A pull that skips
    a request's first blocks (the decode side holds them already) gets those after them;
    one that skips them all, nothing."""
    ctx = mp.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=serve_staged, args=(ports, stop), daemon=True)
    server.start()
    pulls = [("req-b", 0), ("req-a", 0), ("req-c", 0), ("req-b", 2), ("req-a", 1)]
    expected = {(r, skip): pool(seed=1).export_blocks(REQUESTS[r][skip:]) for r, skip in pulls}
    staging, landed = Staging(), []
    try:
        port, tokens = ports.get(timeout=120)

        async def main() -> None:
            client = KvClient(timeout_s=60)
            for request_id, skip in pulls:
                into = staging.take(expected[request_id, skip].shape, torch.float32)
                await client.pull(f"127.0.0.1:{port}", request_id, tokens[request_id],
                                  wire(into), skip=skip)
                landed.append((into.data_ptr(), torch.equal(into, expected[request_id, skip])))
                staging.give(into)
            with pytest.raises(TransferError, match="no KV for req-c"):
                await client.pull(f"127.0.0.1:{port}", "req-c", tokens["req-c"], wire(into),
                                  skip=1)
            await client.close()

        asyncio.run(main())
        stop.set()
        served, server_fresh, server_kept = ports.get(timeout=30)
    finally:
        stop.set()
        server.join(timeout=30)
        if server.is_alive():
            server.kill()
    assert all(equal for _, equal in landed)
    assert len({pointer for pointer, _ in landed}) == 1 and staging.fresh == 1
    assert (served, server_fresh, server_kept) == (5, 1, True)


@pytest.mark.timeout(180)
def test_an_endpoint_opened_ahead_carries_the_first_pull(server_port: Any) -> None:
    """`connect` opens the endpoint a pull would otherwise open first; the pull then goes
    on it. Nobody listening: False, and no endpoint is kept."""
    port, token, *_ = server_port
    address = f"127.0.0.1:{port}"
    buffer = torch.empty_like(pool(seed=1).export_blocks(SOURCE_BLOCKS))

    async def main() -> None:
        client = KvClient(timeout_s=20)
        assert not client.connected(address)
        assert await client.connect(address) and client.connected(address)
        opened = client._endpoints[address]
        assert await client.connect(address)  # open already: the same endpoint
        await client.pull(address, "req-1", token, buffer.numpy())
        assert client._endpoints[address] is opened
        client.drop(address)  # its prefill instance left the registry: closed
        assert not client.connected(address) and not client._endpoints
        await client.pull(address, "req-1", token, buffer.numpy())  # opens another
        assert client.connected(address) and client._endpoints[address] is not opened
        await client.close()
        assert not client._endpoints
        nobody = KvClient(timeout_s=2)  # UCX gives up on a closed port only at the timeout
        assert not await nobody.connect("127.0.0.1:1")
        assert not nobody.connected("127.0.0.1:1")

    asyncio.run(main())
    assert torch.equal(buffer, pool(seed=1).export_blocks(SOURCE_BLOCKS))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("server_port", [torch.bfloat16], indirect=True)
def test_a_bfloat16_pool_moves_as_its_bytes(server_port: Any) -> None:
    """numpy has no bfloat16 (and an older torch gives it no CUDA typestr): both sides hand
    UCX the blocks' bytes, the way the services do."""
    port, token, _, ports, stop, _ = server_port
    expected = pool(seed=1, dtype=torch.bfloat16).export_blocks(SOURCE_BLOCKS)
    buffer = torch.zeros_like(expected)

    async def main() -> None:
        client = KvClient()
        assert await pull_pieces(client, "req-1", token, [(f"127.0.0.1:{port}",
                                 KvSpan.whole(CFG))], KvSpan.whole(CFG), buffer) == 1
        await client.close()

    asyncio.run(main())
    assert buffer.dtype == torch.bfloat16 and torch.equal(buffer, expected)
    stop.set()
    assert ports.get(timeout=30) == (expected.nbytes, 1)


@pytest.mark.timeout(180)
def test_a_pull_needs_the_requests_token(server_port: Any) -> None:
    port, token, unknown_token, ports, stop, _ = server_port
    expected = pool(seed=1).export_blocks(SOURCE_BLOCKS)
    buffer = torch.zeros_like(expected)

    async def main() -> None:
        client = KvClient()
        address = f"127.0.0.1:{port}"
        for wrong in ("", "0" * 32, unknown_token, token[:-1], token + "0", "é" * 32):
            with pytest.raises(TransferError, match=r"^no KV for req-1$"):  # reveals nothing
                await client.pull(address, "req-1", wrong, buffer.numpy())
        assert not buffer.any()
        await client.pull(address, "req-1", token, buffer.numpy())  # the same endpoint
        await client.close()

    asyncio.run(main())
    assert torch.equal(buffer, expected)
    stop.set()
    assert ports.get(timeout=30) == (expected.nbytes, 1)  # sent once, to the token's holder


@pytest.mark.timeout(180)
def test_a_pull_from_a_frozen_peer_is_abandoned(server_port: Any) -> None:
    """SIGSTOP the prefill side mid-conversation: the pull times out instead of hanging, and
    once the peer answers again a pull on a fresh endpoint gets the right bytes (not the
    abandoned pull's late reply)."""
    port, token, _, _, _, pid = server_port
    expected = pool(seed=1).export_blocks(SOURCE_BLOCKS)
    buffer = torch.zeros_like(expected)
    address = f"127.0.0.1:{port}"

    async def main() -> None:
        client = KvClient(timeout_s=2.0)
        await client.pull(address, "req-1", token, buffer.numpy())  # the endpoint is open
        buffer.zero_()
        os.kill(pid, signal.SIGSTOP)
        try:
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(TransferError, match="abandoned"):
                await client.pull(address, "req-1", token, buffer.numpy())
            assert loop.time() - start < 30  # bounded by the timeout, not hung
        finally:
            os.kill(pid, signal.SIGCONT)
        await client.pull(address, "req-1", token, buffer.numpy())
        await client.close()

    asyncio.run(main())
    assert torch.equal(buffer, expected)


def pull_through_a_freeze(port: int, token: str, server_pid: int) -> None:
    """The decode side, in its own process: pulls keep coming while the peer is frozen
    (each given up on, most of them mid-handshake on a new endpoint), then go on once it
    answers again. The process must outlive the peer's late answers."""
    expected = pool(seed=1).export_blocks(SOURCE_BLOCKS).numpy()
    address = f"127.0.0.1:{port}"

    async def main() -> None:
        client = KvClient(timeout_s=60.0)
        await client.pull(address, "req-1", token, np.empty_like(expected))
        client.timeout_s = 0.5
        os.kill(server_pid, signal.SIGSTOP)
        try:
            for _ in range(8):  # each one given up on, its buffer freed
                with contextlib.suppress(TransferError):
                    await client.pull(address, "req-1", token, np.empty_like(expected))
                gc.collect()
        finally:
            os.kill(server_pid, signal.SIGCONT)
        client.timeout_s = 60.0
        garbage = []
        for _ in range(40):  # the late answers land meanwhile
            buffer = np.empty_like(expected)
            await client.pull(address, "req-1", token, buffer)
            assert np.array_equal(buffer, expected)
            garbage.append([np.ones(1000) for _ in range(100)])
            await asyncio.sleep(0.1)
        await client.close()

    asyncio.run(main())
    stop_notifier_thread()


@pytest.mark.timeout(300)
def test_pulls_given_up_on_a_frozen_peer_do_not_corrupt_the_puller(server_port: Any) -> None:
    """ucxx's endpoint handshake, given up on, left UCX a freed buffer to write the late
    answer into: the decode instance died of heap corruption once a frozen prefill instance
    went on (kv_transfer replaces that handshake)."""
    port, token, _, _, _, pid = server_port
    puller = mp.get_context("spawn").Process(target=pull_through_a_freeze,
                                             args=(port, token, pid))
    puller.start()
    puller.join(timeout=240)
    assert puller.exitcode == 0, f"the puller ended with {puller.exitcode}"


def other_address() -> str | None:
    """An IPv4 address of this host that is not loopback, if it has one."""
    addresses = [interface_ipv4(name) for _, name in socket.if_nameindex()]
    return next((a for a in addresses if a and not a.startswith("127.")), None)


@pytest.mark.timeout(180)
def test_the_listener_serves_through_its_own_address_only(server_port: Any) -> None:
    port, token, _, _, _, _ = server_port
    address = other_address()
    if address is None:
        pytest.skip("this host has no network interface besides loopback")
    buffer = bytearray(pool(seed=1).export_blocks(SOURCE_BLOCKS).nbytes)

    async def main() -> None:
        client = KvClient()
        with pytest.raises(TransferError):  # UCX rejects it: not on the listener's device
            await asyncio.wait_for(client.pull(f"{address}:{port}", "req-1", token, buffer),
                                   30)

    asyncio.run(main())


def test_the_listeners_device_is_the_one_holding_its_address() -> None:
    assert net_device("127.0.0.1") == "lo"
    assert net_device("localhost") == "lo"
    with pytest.raises(ValueError, match="on no network interface"):
        net_device("203.0.113.7")  # TEST-NET-3: no host's own address


@pytest.mark.timeout(60)
def test_pull_from_nobody_fails_cleanly() -> None:
    async def main() -> None:
        client = KvClient()
        with pytest.raises(TransferError):
            await asyncio.wait_for(client.pull("127.0.0.1:1", "x", "t", bytearray(8)), 30)

    asyncio.run(main())
