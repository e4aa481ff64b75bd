"""Parallel instances in the stack: a prefill instance at tp 3 hands its KV (each rank serving
its KV heads) to a one-rank decode instance, a one-rank prefill instance to a decode instance
of 2 pipeline stages (each pulling its layers), and the one at tp 3 to the one of 2 stages
(each decode rank pulling its layers from every prefill rank); the openai client gets the
single-process engine's greedy text, and the KV crosses over UCX once."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import psutil
import pytest
from redis import Redis

from services.launcher import Stack
from shared import subjects
from shared.engine.block_manager import blocks_for
from shared.engine.engine import Engine
from shared.engine.kv_cache import block_bytes
from shared.state import InstanceInfo
from tests.services.conftest import greedy, metric, start_stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
MODEL = "smollm2-135m"
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time"]


@pytest.fixture(scope="module", params=[dict(prefill_tp=3), dict(decode_pp=2),
                                        dict(prefill_tp=3, decode_pp=2)],
                ids=["prefill-tp3", "decode-pp2", "prefill-tp3-decode-pp2"])
def tp_stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("stack"), prefill=1, decode=1, **request.param)
    yield s
    s.stop()


def test_instances_of_different_tp_serve_the_single_process_text(
        tp_stack: Stack, engine: Engine) -> None:
    tokenizer = engine.tokenizer
    assert tokenizer is not None
    ids = [tokenizer.encode(p) for p in PROMPTS]
    expected = [greedy(engine, i, 16) for i in ids]
    before = metric(tp_stack.url, "ds_kv_transfer_bytes_total")
    c = openai.OpenAI(base_url=f"{tp_stack.url}/v1", api_key="unused", timeout=120)

    def stream(prompt: str) -> str:
        return "".join(ch.choices[0].text for ch in c.completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True)
            if ch.choices)

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        assert list(pool.map(stream, PROMPTS)) == expected
    # one copy of each request's KV crossed over UCX: every layer and KV head of its blocks
    block = block_bytes(engine.model_config, 16, engine.runner.dtype)
    one_copy = sum(blocks_for(len(i), 16) * block for i in ids)
    deadline = time.monotonic() + 10  # the counts travel in heartbeats
    while True:
        after = metric(tp_stack.url, "ds_kv_transfer_bytes_total")
        moved = {i: after[i] - before.get(i, 0) for i in after}
        pulled = sum(v for i, v in moved.items() if i.startswith("decode"))
        served = sum(v for i, v in moved.items() if i.startswith("prefill"))
        if pulled == served == one_copy or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert pulled == served == one_copy
    # each worker runs its other ranks as child processes
    config = tp_stack.config
    shape = {role: (config.tp_for(role), config.pp_for(role)) for role in ("prefill", "decode")}
    for child in tp_stack.children:
        role = child.name.split("-")[0]
        if role in shape:
            ranks = [p for p in psutil.Process(child.proc.pid).children()
                     if "shared.engine.parallel.rank" in " ".join(p.cmdline())]
            assert len(ranks) == shape[role][0] * shape[role][1] - 1, child.name
    # the registry tells each instance's tp and pp (the planner and `plan --live` read it)
    with Redis.from_url(tp_stack.env["DS_REDIS_URL"]) as redis:
        registered = {}
        for role in shape:
            infos = [InstanceInfo.model_validate_json(redis.get(subjects.instance_key(
                i.decode())) or b"{}") for i in redis.smembers(subjects.role_set(role))]
            registered[role] = [(info.tp, info.pp) for info in infos]
    assert registered == {role: [tp_pp] for role, tp_pp in shape.items()}
    logs = {c.name: Path(c.log).read_text() for c in tp_stack.children}
    assert all("Traceback" not in text for text in logs.values())
