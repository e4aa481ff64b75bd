from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def distserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "distserve.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_generate_prints_the_greedy_completion() -> None:
    result = distserve("generate", "The capital of France is", "--max-tokens", "8")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["   "], "the prompt is empty"),
    (["hi", "--max-tokens", "-3"], "max_tokens must be at least 1"),
    (["hi", "--max-tokens", "9000"], "exceeds the model's context of 8192"),
    (["hi", "--temperature", "-1"], "temperature must be >= 0"),
    (["hi", "--model", "nope"], "unknown model 'nope'"),
    (["hi", "--device", "tpu"], "unknown device 'tpu': choose cpu, cuda, cuda:N or auto"),
    (["hi", "--device", "cuda:99"], "device 'cuda:99': "),  # no CUDA, or not 100 devices
    (["hi", "--stop", ""], "a stop string must not be empty"),
    (["hi", "--threads", "-1"], "must be 0 or more"),
])
def test_bad_arguments_exit_2_with_a_clear_message(args: list[str], message: str) -> None:
    result = distserve("generate", *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
