"""Supervision end to end: the stack's only prefill instance is killed, comes back under a new
instance id, and the stack serves again."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.services.conftest import start_stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
MODEL = "smollm2-135m"


def health(url: str) -> dict[str, Any]:
    try:
        answer: dict[str, Any] = httpx.get(f"{url}/health", timeout=5).json()
    except httpx.HTTPError:
        return {}
    return answer


def test_a_killed_prefill_instance_is_restarted_and_serves_again(tmp_path: Path) -> None:
    stack = start_stack(tmp_path, prefill=1, decode=1)
    try:
        killed = stack.child("prefill-0").pid
        os.kill(killed, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while (state := health(stack.url)).get("instance_ids") != ["decode-0", "prefill-0-r1"]:
            assert time.monotonic() < deadline, f"not healthy again within 60 s: {state}"
            time.sleep(0.5)
        assert state["status"] == "ok"
        assert stack.restarts()["prefill-0"] == 1 and stack.child("prefill-0").pid != killed
        response = httpx.post(f"{stack.url}/v1/completions", timeout=120,
                              json={"model": MODEL, "prompt": "The capital of France is",
                                    "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 6
        log = (stack.run_dir / "prefill-0.log").read_text()
        assert "--- supervisor: restart 1 at " in log  # both incarnations, one log
    finally:
        stack.stop()
    assert stack.children == []
