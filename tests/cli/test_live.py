"""`distserve plan --live`: a recorded plan as printed, and never a run's Redis password; a
stack that is gone is said to be, at once."""

import socket
import time
from pathlib import Path

import pytest

from distserve.cli import main
from distserve.commands.common import without_password
from distserve.commands.live import layout


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("replan", [False, True])
def test_a_run_whose_stack_is_gone_is_named_not_waited_for(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], replan: bool) -> None:
    run = tmp_path / "20260101-000000-1"
    run.mkdir()
    port = closed_port()
    (run / "env").write_text(f"DS_REDIS_URL=redis://:pw@127.0.0.1:{port}\n"
                             f"DS_NATS_URL=nats://127.0.0.1:{port}\n")
    began = time.monotonic()
    with pytest.raises(SystemExit) as stopped:
        main(["plan", "--live", "--run-dir", str(tmp_path), *(["--replan"] if replan else [])])
    assert stopped.value.code == 2
    assert time.monotonic() - began < 60  # it used to retry NATS for ever
    error = capsys.readouterr().err
    assert f"cannot reach {'NATS' if replan else 'Redis'} at" in error
    assert "is its stack still running?" in error and str(run) in error
    assert "pw" not in error and "Traceback" not in error


def test_a_redis_url_is_printed_without_its_password() -> None:
    assert without_password("redis://:s3cret@127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert without_password("redis://127.0.0.1:6379") == "redis://127.0.0.1:6379"


def test_a_recorded_plan_names_its_workers_and_their_shapes() -> None:
    split = {"mode": "disaggregated", "prefill": 1, "decode": 2,
             "prefill_shape": {"tp": 2, "pp": 1}, "decode_shape": {"tp": 1, "pp": 1}}
    assert layout(split) == "1 prefill tp2 + 2 decode"
    assert layout(split, short=True) == "1P tp2+2D"
    # records written before plans had shapes: one device each
    assert layout({"mode": "disaggregated", "prefill": 1, "decode": 1}, short=True) == "1P+1D"
    assert layout({"mode": "chunked", "colocated": 2,
                   "colocated_shape": {"tp": 2, "pp": 2}}) == "2 chunked colocated tp2 pp2"
