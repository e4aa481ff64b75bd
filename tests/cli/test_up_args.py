"""`distserve up` refuses, before it starts anything, what it cannot run: an instance count
its mode does not start, a NATS or Redis given by URL that does not answer, a KV budget
that holds no block of the model; and what it says as it stops. No stack is started here
(stopping one: tests/services/test_shutdown.py)."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models

from distserve.cli import build_parser
from distserve.commands.up import check_servers, in_flight, instance_counts, stopping_message
from services.launcher import Stack, StackConfig, nats_problem, redis_problem, within

pytestmark = pytest.mark.timeout(120)


def parsed(*argv: str) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    args = build_parser("up").parse_args(["up", *argv])
    return args, args.parser


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A port of 127.0.0.1 held by a socket that does not listen: connections are refused."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield held.getsockname()[1]


@pytest.fixture
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def up(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "distserve.cli", "up", *argv],
                          capture_output=True, text=True, timeout=100,
                          env=os.environ | {"DS_DEVICE": "cpu"})


@pytest.mark.parametrize(("argv", "message"), [
    (["--mode", "colocated", "--prefill", "2"],
     "--mode colocated does not take --prefill: it takes --replicas"),
    (["--mode", "colocated", "--prefill", "1", "--decode", "2"],
     "--mode colocated does not take --prefill or --decode: it takes --replicas"),
    (["--replicas", "2"],
     "--mode disaggregated does not take --replicas: it takes --prefill and --decode"),
])
def test_a_count_the_mode_does_not_start_is_refused(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    args, parser = parsed(*argv)
    with pytest.raises(SystemExit) as exit_:
        instance_counts(args, parser)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_the_counts_not_given_are_one_each(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, counts in ((["--prefill", "2"], (2, 1, 1)),
                         (["--mode", "colocated", "--replicas", "3"], (1, 1, 3)),
                         (["--mode", "colocated"], (1, 1, 1))):
        args, parser = parsed(*argv)
        instance_counts(args, parser)
        assert (args.prefill, args.decode, args.replicas) == counts
    with pytest.raises(SystemExit):
        parsed("--decode", "0")
    assert "argument --decode: must be a positive integer, got 0" in capsys.readouterr().err


def test_a_nats_or_redis_that_does_not_answer_is_refused_by_its_url_without_password(
        closed_port: int, capsys: pytest.CaptureFixture[str]) -> None:
    for flag, name, scheme in (("--nats-url", "NATS", "nats"), ("--redis-url", "Redis", "redis")):
        args, parser = parsed(flag, f"{scheme}://user:secret@127.0.0.1:{closed_port}")
        with pytest.raises(SystemExit) as exit_:
            check_servers(args, parser)
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"cannot reach {name} at {scheme}://127.0.0.1:{closed_port}: " in err
        assert "secret" not in err and "Traceback" not in err
    check_servers(*parsed())  # none given: the stack starts its own


def test_a_server_that_takes_the_connection_and_never_answers_is_refused_in_time() -> None:
    """A port that accepts and says nothing (a server hung, a firewall's black hole): each
    check gives up within its time, saying so, however the client library waits."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        for problem, scheme in ((nats_problem, "nats"), (redis_problem, "redis")):
            began = time.monotonic()
            why = problem(f"{scheme}://127.0.0.1:{port}", timeout_s=0.5)
            assert why is not None and time.monotonic() - began < 5.0
        assert within(0.2, lambda: time.sleep(3) or None) == "no answer within 0.2 s"


def test_up_starts_nothing_where_its_redis_does_not_answer(
        tmp_path: Path, closed_port: int, free_port: int) -> None:
    done = up("--redis-url", f"redis://:secret@127.0.0.1:{closed_port}", "--port",
              str(free_port), "--run-dir", str(tmp_path))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"distserve up: error: cannot reach Redis at redis://127.0.0.1:{closed_port}: Error 111 "
        f"connecting to 127.0.0.1:{closed_port}. Connection refused.")
    assert list(tmp_path.iterdir()) == []  # no run directory: nothing was started


def big_kv_model(directory: Path) -> Path:
    """A model directory of a Llama-2-7B shape (no weights: `up` reads none before it
    starts the workers): a KV block of 16 float32 tokens takes 16 MiB."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 11008,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "vocab_size": 2}))
    Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")).save(
        str(directory / "tokenizer.json"))
    return directory


def test_a_kv_budget_under_one_block_of_the_model_is_refused_with_the_minimum(
        tmp_path: Path, closed_port: int, free_port: int) -> None:
    model = big_kv_model(tmp_path / "llama-7b-shape")
    # the Redis that does not answer: were the budget taken, up would stop there
    done = up("--model", str(model), "--kv-cache-mb", "8", "--redis-url",
              f"redis://127.0.0.1:{closed_port}", "--port", str(free_port), "--run-dir",
              str(tmp_path / "runs"))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "distserve up: error: prefill workers: a KV cache of 8 MiB holds no block of "
        "llama-7b-shape (a block of 16 tokens takes 16 MiB a rank): give --kv-cache-mb 16 "
        "or more")
    assert not (tmp_path / "runs").exists()


def test_up_says_what_it_drains_as_it_stops_and_how_not_to_wait() -> None:
    assert stopping_message(3, 120.0) == ("stopping: draining 3 requests in flight (up to "
                                          "120 s); Ctrl-C again to stop now")
    assert stopping_message(1, 300.0).startswith("stopping: draining 1 request in flight (up "
                                                  "to 300 s)")
    assert stopping_message(None, 120.0).startswith("stopping: draining requests in flight")


def test_the_requests_in_flight_are_not_known_where_no_gateway_answers(
        tmp_path: Path, closed_port: int) -> None:
    assert in_flight(Stack(StackConfig(port=closed_port, run_dir=tmp_path))) is None
