"""KV blocks exported from one process's pool arrive over UCX in another's, bit for bit."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
from typing import Any

import pytest
import torch

from shared.engine.config import LLAMA_SHAPES
from shared.engine.kv_cache import KVCache
from shared.kv_transfer import KvClient, KvServer, TransferError

CFG = LLAMA_SHAPES["tiny"]
SOURCE_BLOCKS = [5, 2, 9]


def pool(seed: int) -> KVCache:
    kv = KVCache(CFG, 16, 4, torch.float32, torch.device("cpu"))
    kv.data.copy_(torch.randn(kv.data.shape, generator=torch.Generator().manual_seed(seed)))
    return kv


def serve(ports: Any, stop: Any) -> None:
    """The prefill side, in its own process."""
    kv = pool(seed=1)
    exported = {"req-1": kv.export_blocks(SOURCE_BLOCKS).numpy()}

    async def main() -> None:
        server = KvServer(lookup=exported.get)
        server.start()
        ports.put(server.port)
        while not stop.is_set():
            await asyncio.sleep(0.05)
        ports.put(server.stats.bytes)
        server.close()

    asyncio.run(main())


@pytest.fixture
def server_port() -> Any:
    ctx = mp.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=serve, args=(ports, stop), daemon=True)
    proc.start()
    port = ports.get(timeout=120)
    yield port, ports, stop
    stop.set()
    proc.join(timeout=30)
    if proc.is_alive():
        proc.kill()


@pytest.mark.timeout(180)
def test_pull_moves_blocks_between_processes(server_port: Any) -> None:
    port, ports, stop = server_port
    expected = pool(seed=1).export_blocks(SOURCE_BLOCKS)
    decode = pool(seed=2)
    target = [0, 11, 7]
    buffer = torch.empty_like(expected)

    async def main() -> None:
        client = KvClient()
        await client.pull(f"127.0.0.1:{port}", "req-1", buffer.numpy())
        with pytest.raises(TransferError, match="no KV for req-unknown"):
            await client.pull(f"127.0.0.1:{port}", "req-unknown", buffer.numpy())
        assert client.stats.requests == 1 and client.stats.bytes == buffer.nbytes
        await client.close()

    asyncio.run(main())
    decode.import_blocks(target, buffer)
    assert torch.equal(decode.export_blocks(target), expected)
    stop.set()
    assert ports.get(timeout=30) == expected.nbytes  # the server counted what it sent


@pytest.mark.timeout(60)
def test_pull_from_nobody_fails_cleanly() -> None:
    async def main() -> None:
        client = KvClient()
        with pytest.raises(TransferError):
            await asyncio.wait_for(client.pull("127.0.0.1:1", "x", bytearray(8)), 30)

    asyncio.run(main())
