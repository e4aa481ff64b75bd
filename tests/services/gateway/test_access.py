"""Access control of a launched stack: its NATS and Valkey take the run's credentials only,
the secrets sit in files only their owner reads and on no command line, the API keys reach
the gateway alone, and a request still goes prefill -> KV pull (with its token) -> decode."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import nats
import pytest
from nats.errors import Error as NatsError
from redis import Redis
from redis.exceptions import AuthenticationError

from services.launcher import Stack
from tests.services.gateway.conftest import API_KEY, OTHER_KEY

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
MODEL = "smollm2-135m"


def password(url: str) -> str:
    secret = urlsplit(url).password
    assert secret, f"no password in the run's {urlsplit(url).scheme} URL"
    return secret


def without_credentials(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}:{parts.port}"


async def quiet(_: Exception) -> None:
    """nats-py's default error callback prints the refusal's traceback."""


async def nats_connect(url: str) -> None:
    nc = await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0,
                            connect_timeout=5, error_cb=quiet)
    await nc.publish("ds.test.access", b"hello")
    await nc.flush(timeout=5)
    await nc.close()


# --- the servers' credentials ---

def test_nats_refuses_a_client_without_the_runs_credentials(secured: Stack) -> None:
    url = secured.env["DS_NATS_URL"]
    secret = password(url)
    for wrong in (without_credentials(url), url.replace(secret, secret[::-1])):
        with pytest.raises(NatsError, match="Authorization Violation"):
            asyncio.run(nats_connect(wrong))
    asyncio.run(nats_connect(url))


def test_valkey_refuses_a_client_without_the_runs_password(secured: Stack) -> None:
    url = secured.env["DS_REDIS_URL"]
    password(url)
    with Redis.from_url(without_credentials(url)) as redis, \
            pytest.raises(AuthenticationError):
        redis.ping()
    with Redis.from_url(url) as redis:
        assert redis.ping()


# --- where the secrets are kept ---

def test_secret_files_are_readable_by_their_owner_only(secured: Stack) -> None:
    for name in ("env", "nats.conf", "valkey.conf"):
        assert stat.S_IMODE((secured.run_dir / name).stat().st_mode) == 0o600, name


def test_no_secret_on_a_command_line_and_api_keys_to_the_gateway_only(secured: Stack) -> None:
    kept = [password(secured.env["DS_NATS_URL"]), password(secured.env["DS_REDIS_URL"]),
            API_KEY, OTHER_KEY]
    for child in secured.children:
        proc = Path(f"/proc/{child.proc.pid}")
        cmdline = (proc / "cmdline").read_bytes().decode()
        assert not any(secret in cmdline for secret in kept), child.name
        environ = dict(line.split("=", 1) for line in
                       (proc / "environ").read_bytes().decode().split("\0") if "=" in line)
        keys = f"{API_KEY},{OTHER_KEY}"
        assert environ.get("DS_API_KEYS") == (keys if child.name == "gateway" else None), \
            child.name


# --- a request still crosses the stack (its KV pull presents the request's token) ---

def test_a_request_goes_through_prefill_kv_pull_and_decode(secured: Stack) -> None:
    response = httpx.post(f"{secured.url}/v1/completions", timeout=120,
                          headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": MODEL, "prompt": "The capital of France is",
                                "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 6  # 1 from prefill, 5 from decode
