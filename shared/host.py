"""What CPU this is, as the engine's kernels and the latency profiles need to know it: its
feature flags (a kernel build is named by them) and a short description a profile records,
since a profile measured on one CPU prices steps wrong on another (the same engine ran a
decode step 1.9-3.5x faster on an AMD EPYC than the Intel profile said)."""

from __future__ import annotations

import functools
import socket
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def _cpuinfo(keys: tuple[str, ...]) -> str:
    """The first /proc/cpuinfo value under one of `keys` ('' where there is none)."""
    try:
        for line in CPUINFO.read_text().splitlines():
            if line.startswith(keys):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo), empty where the system does not say."""
    return frozenset(_cpuinfo(("flags", "Features")).split())  # x86, ARM


def vector_isa(flags: frozenset[str]) -> str:
    """The widest x86 vector extension the engine's kernels build for: avx512, avx2 or the
    baseline (the name a profile records beside the CPU's model)."""
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else "baseline"


# the flags of dot products in each 16-bit float: without one, torch's CPU matmuls in it
# convert to float32 as they go
NATIVE_16BIT = {"bfloat16": frozenset({"avx512_bf16", "amx_bf16"}),
                "float16": frozenset({"avx512_fp16", "amx_fp16"})}


def computes_natively(dtype: str, flags: frozenset[str]) -> bool:
    """Whether a CPU of `flags` has dot products in `dtype` ("bfloat16", "float16"; float32
    always)."""
    return dtype not in NATIVE_16BIT or bool(NATIVE_16BIT[dtype] & flags)


def cpu_description() -> str:
    """'AMD EPYC (family 23 model 1, avx2)': what a CPU profile was measured on."""
    name = _cpuinfo(("model name",)) or "unknown CPU"
    family, model = _cpuinfo(("cpu family",)), _cpuinfo(("model\t", "model "))
    where = f"family {family} model {model}, " if family and model else ""
    return f"{name} ({where}{vector_isa(cpu_flags())})"


@functools.cache
def machine_id() -> str:
    """Which machine this process runs on, the same for every process and container of one
    running kernel (its boot id; else the host name): the instances whose steps contend for
    its cores and memory bandwidth."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return socket.gethostname()
