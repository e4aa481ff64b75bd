"""What CPU this is: the flags a kernel build is named by, the description a profile keeps."""

from __future__ import annotations

import logging
import platform
from pathlib import Path

import pytest
import torch

from shared import host
from shared.engine import model_runner


def test_the_widest_vector_extension_names_the_kernels_build() -> None:
    assert host.vector_isa(frozenset({"avx2", "fma", "avx512f", "avx512bw"})) == "avx512"
    assert host.vector_isa(frozenset({"sse4_2", "avx", "avx2", "fma"})) == "avx2"
    assert host.vector_isa(frozenset({"sse4_2", "avx2"})) == "baseline"  # no FMA, no AVX2 path
    assert host.vector_isa(frozenset()) == "baseline"


@pytest.mark.parametrize(("flags", "bfloat16", "float16"), [
    ({"avx2", "fma", "avx512f", "avx512_bf16"}, True, False),  # a Zen 4/5 EPYC
    ({"avx512f", "amx_bf16", "amx_fp16", "avx512_fp16"}, True, True),  # a Granite Rapids Xeon
    ({"avx2", "fma"}, False, False),  # a Zen 3 EPYC
])
def test_an_instance_in_a_16_bit_dtype_is_warned_where_the_cpu_only_emulates_it(
        flags: set[str], bfloat16: bool, float16: bool, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """torch's CPU matmuls in a 16-bit float without the CPU's dot products in it convert to
    float32 as they go: a worker asked for one there loads (it computes the same) and says so
    in its log; float32 is never warned about."""
    assert host.computes_natively("bfloat16", frozenset(flags)) == bfloat16
    assert host.computes_natively("float16", frozenset(flags)) == float16
    assert host.computes_natively("float32", frozenset())
    monkeypatch.setattr(model_runner, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(model_runner, "prefill_matmul_ms", lambda *_: (1.0, 1.3))  # it pays
    for name, native in (("bfloat16", bfloat16), ("float16", float16), ("float32", True)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=model_runner.__name__):
            dtype = model_runner.resolve_dtype(name, torch.device("cpu"))
        assert dtype == model_runner.DTYPES[name]
        warned = [r.getMessage() for r in caplog.records]
        assert bool(warned) != native, warned
        assert all(f"no {name} dot products" in w for w in warned)


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


def test_a_16_bit_dtype_the_cpu_has_dot_products_for_is_timed_before_it_is_trusted(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """AVX512_BF16 alone is no promise: a Xeon (family 6 model 207, no AMX) ran torch's
    bfloat16 GEMMs 1.4-1.7x slower than float32's, where a Zen 5 with the same flag ran them
    1.3x faster. A worker asked for bfloat16 there times one prefill-shaped matmul in each
    and says which is faster."""
    monkeypatch.setattr(model_runner, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    for timed, slower in (((5.4, 3.0), True), ((2.3, 3.0), False)):
        monkeypatch.setattr(model_runner, "prefill_matmul_ms", lambda *_, t=timed: t)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=model_runner.__name__):
            assert model_runner.resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
        warned = [r.getMessage() for r in caplog.records]
        assert bool(warned) == slower, warned
        assert all("slower than float32's on this CPU" in w and "5.4 ms, float32 3.0" in w
                   for w in warned)


def test_the_matmul_probe_times_both_dtypes() -> None:
    ms, ms_float32 = model_runner.prefill_matmul_ms.__wrapped__("bfloat16", 1, rows=16)
    assert 0 < ms < 10_000 and 0 < ms_float32 < 10_000
