"""What CPU this is: the flags a kernel build is named by, the description a profile keeps."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from shared import host


def test_the_widest_vector_extension_names_the_kernels_build() -> None:
    assert host.vector_isa(frozenset({"avx2", "fma", "avx512f", "avx512bw"})) == "avx512"
    assert host.vector_isa(frozenset({"sse4_2", "avx", "avx2", "fma"})) == "avx2"
    assert host.vector_isa(frozenset({"sse4_2", "avx2"})) == "baseline"  # no FMA, no AVX2 path
    assert host.vector_isa(frozenset()) == "baseline"


def test_a_cpu_is_described_by_its_model_and_vector_extension(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 23\n"
                       "model\t\t: 1\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 fma\n")
    monkeypatch.setattr(host, "CPUINFO", cpuinfo)
    assert host.cpu_description() == "AMD EPYC (family 23 model 1, avx2)"
    assert host.cpu_flags() == {"fpu", "sse2", "avx2", "fma"}
    monkeypatch.setattr(host, "CPUINFO", tmp_path / "missing")
    assert host.cpu_description() == "unknown CPU (baseline)"
    assert host.cpu_flags() == frozenset()


def test_this_machine_describes_itself() -> None:
    if platform.system() != "Linux":
        pytest.skip("/proc/cpuinfo is Linux's")
    assert host.cpu_description() != "unknown CPU (baseline)"
