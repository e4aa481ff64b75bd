"""Stacks of real processes (nats-server, valkey-server, workers, gateway) on free ports."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from distserve.bench import scrape
from services.launcher import Stack, StackConfig
from services.supervisor import free_port
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.request import SamplingParams


def start_stack(tmp: Path, **config: object) -> Stack:
    """A stack of `config`, over which DS_TEST_STACK (JSON: StackConfig's fields; its
    `extra_env` over the test's, key by key) wins: on a GPU machine, where the GGUF does not
    travel, the tests that compare a stack with itself (test_failover.py) serve a model
    directory under the name they ask for, e.g. {"model": "/tmp/m", "served_model_name":
    "smollm2-135m", "dtype": "float32"} (benchmarks/gpu_check.sh services). Those that
    compare it with the built-in GGUF's engine do not fit it."""
    given = json.loads(os.environ.get("DS_TEST_STACK", "{}"))
    extra = {"DS_HEARTBEAT_TTL_S": "2", "DS_STALL_TIMEOUT_S": "30", "DS_KV_LEASE_S": "4",
             **config.pop("extra_env", {}),  # type: ignore[dict-item]
             **given.pop("extra_env", {})}
    config |= given
    stack = Stack(StackConfig(port=free_port(), run_dir=tmp, extra_env=extra,
                              **config))  # type: ignore[arg-type]
    stack.start(timeout=600)
    return stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("stack"), prefill=2, decode=2, decode_weights="int4")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineConfig())


def greedy(engine: Engine, prompt_ids: list[int], max_tokens: int) -> str:
    (request,) = engine.generate([prompt_ids], SamplingParams(max_tokens=max_tokens))
    assert engine.tokenizer is not None
    return engine.tokenizer.decode(request.output_ids)


def metric(url: str, name: str) -> dict[str, float]:
    """{instance: value} of a gauge on the gateway's /metrics (a counter: `<name>_total`)."""
    return metrics(url, name)[name]


def metrics(url: str, *names: str) -> dict[str, dict[str, float]]:
    """{name: {instance: value}} of gauges from one read of the gateway's /metrics, so each
    instance's figures come from the same heartbeat."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {name: {labels["instance"]: value for labels, value in scrape.samples(text, name)}
            for name in names}


def metric_when(url: str, name: str, ok: Callable[[dict[str, float]], bool],
                timeout: float = 20) -> dict[str, float]:
    """A gauge's {instance: value} once `ok` holds of it, or its last reading after `timeout`:
    the instances' figures travel in heartbeats (every 0.5 s), so they may lag what a client
    has already been answered."""
    deadline = time.monotonic() + timeout
    while not ok(reading := metric(url, name)) and time.monotonic() < deadline:
        time.sleep(0.3)
    return reading
