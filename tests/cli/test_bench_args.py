"""`distserve bench` and `replay` refuse, as they parse, what cannot be meant: a length scale,
timeout or speed that is not a positive finite number, a traces folder that is not there."""

from __future__ import annotations

from pathlib import Path

import pytest

from distserve.cli import build_parser

pytestmark = pytest.mark.timeout(60)


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one line argparse exits 2 with on `argv`."""
    with pytest.raises(SystemExit) as exit_:
        build_parser(argv[0]).parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("flag", ["--length-scale", "--timeout"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_bench_and_replay_take_a_positive_length_scale_and_timeout(
        flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["bench", f"{flag}={value}"], ["replay", "t.csv", f"{flag}={value}"]):
        assert f"argument {flag}: must be a positive number, got {value}" in refused(argv,
                                                                                      capsys)


def test_bench_compare_takes_a_positive_length_scale(capsys: pytest.CaptureFixture[str]) -> None:
    line = refused(["bench", "compare", "--length-scale", "0"], capsys)
    assert "argument --length-scale: must be a positive number, got 0" in line


def test_replay_takes_a_positive_speed_and_limit(capsys: pytest.CaptureFixture[str]) -> None:
    assert "argument --speed: must be a positive number, got nan" in refused(
        ["replay", "t.csv", "--speed", "nan"], capsys)
    assert "argument --limit: must be a positive integer, got 0" in refused(
        ["replay", "t.csv", "--limit", "0"], capsys)


def test_bench_traces_is_an_existing_folder(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nonexistent"
    assert f"argument --traces: no such folder: {missing}" in refused(
        ["bench", "--traces", str(missing)], capsys)
    (tmp_path / "file").write_text("")
    assert f"argument --traces: not a folder: {tmp_path / 'file'}" in refused(
        ["bench", "--traces", str(tmp_path / "file")], capsys)
    args = build_parser("bench").parse_args(["bench", "--traces", str(tmp_path)])
    assert args.traces == tmp_path and args.length_scale == 1.0 and args.timeout == 300.0
