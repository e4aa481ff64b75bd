"""Fitting a workload to a model's context: drop what does not fit (as the DistServe artifact
prepares its datasets) or clip it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from distserve.commands.workload_arg import parse_workload
from shared.workloads import Lengths, WorkloadError

ROWS = [(100, 50), (1500, 600), (3000, 10), (1000, 1048)]  # (prompt, output)


def azure_csv(tmp_path: Path, rows: list[tuple[int, int]]) -> Path:
    path = tmp_path / "trace.csv"
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"2023-11-16 18:15:{i:02d}.0000000,{p},{o}" for i, (p, o) in enumerate(rows)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_within_keeps_only_requests_that_fit() -> None:
    lengths = Lengths(np.array([p for p, _ in ROWS]), np.array([o for _, o in ROWS]))
    kept = lengths.within(2048)
    assert kept.prompts.tolist() == [100, 1000] and kept.outputs.tolist() == [50, 1048]
    with pytest.raises(WorkloadError, match="no request of the workload fits a 64-token"):
        lengths.within(64)


def test_parse_workload_drops_by_default_and_clips_on_request(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = f"azure:{azure_csv(tmp_path, ROWS)}"
    dropped = parse_workload(spec, max_context=2048).lengths
    assert sorted(dropped.prompts.tolist()) == [100, 1000]
    assert "2 of 4 requests fit the 2048-token context" in capsys.readouterr().err
    clipped = parse_workload(spec, max_context=2048, fit="clip").lengths
    assert len(clipped.prompts) == 4
    assert clipped.prompts.max() == 1024 and (clipped.prompts + clipped.outputs).max() <= 2048


def test_nothing_fits_names_the_way_out(tmp_path: Path) -> None:
    spec = f"azure:{azure_csv(tmp_path, [(5000, 10)])}"
    with pytest.raises(WorkloadError, match="use --fit clip or a longer --max-context"):
        parse_workload(spec, max_context=2048)
