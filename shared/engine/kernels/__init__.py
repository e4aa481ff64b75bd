"""Hand-written CPU kernels, compiled on first use with torch's C++ extension builder and
cached (TORCH_EXTENSIONS_DIR). Where no compiler is available the engine keeps its pure
torch path and logs why.

They are built for the CPU at hand (-march=native: AVX-512 or AVX2 intrinsics, the rest
vectorised by the compiler), so a cached build must never be loaded on another CPU (a shared
cache, a container image moved between hosts): the build's name carries a digest of the
CPU's feature flags. DS_KERNEL_MARCH names another target instead (e.g. `x86-64-v3` for a
build any AVX2 machine runs, `x86-64` for one without any).

torch marks a build in progress with a lock file that only the builder removes: a process
killed mid-build (a worker restarted by its supervisor) leaves it, and every later process
waits on it forever. So builds here are serialised by an advisory lock the kernel drops
when its holder dies; whoever holds it knows any torch lock file left is stale."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import ModuleType

from shared.host import cpu_flags

log = logging.getLogger(__name__)
# vec.h first: torch names a build by the hash of its sources, and an #include'd header is not
# one of them, so its text goes in too, and the sources' #include of it goes (`source_text`)
SOURCES = [Path(__file__).with_name(f)
           for f in ("vec.h", "paged_attention.cpp", "quantized_matmul.cpp", "float_matmul.cpp",
                     "layer_ops.cpp", "decode_layers.cpp", "sampling.cpp")]
OWN_HEADER = '#include "vec.h"'
# What the Python bindings need, in place of the <torch/extension.h> torch would put first:
# that header is the whole C++ frontend and took 64 s of a 66 s build on a Zen 3; the sources
# include the ATen headers they use, and the build parses in about a third of the time
BINDING_HEADERS = "#include <torch/csrc/utils/pybind.h>\n#include <torch/csrc/Exceptions.h>"

FUNCTIONS = ["paged_decode_attention", "quantized_matmul", "float_matmul", "panel_width",
             "rms_norm", "silu_mul", "rope", "decode_layers", "sample_rows", "mask_rows"]
__all__ = ["build_name", "cpu_flags", "cpu_kernels"]


@contextlib.contextmanager
def build_lock(name: str) -> Iterator[None]:
    """Hold the build of extension `name` to this process; a stale torch lock goes."""
    from torch.utils.cpp_extension import _get_build_directory

    build_dir = Path(_get_build_directory(name, verbose=False))
    with (build_dir / "distserve.flock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released by the kernel if this process dies
        stale = build_dir / "lock"
        if stale.exists():
            log.warning("removing %s, left by a build that was killed", stale)
            stale.unlink(missing_ok=True)
        yield


def source_text(source: Path) -> str:
    """A source as the build gets it: without its #include of vec.h (whose text comes
    first), so the build needs no include path. A path among the build's arguments would
    enter torch's cache key: two checkouts of the same sources would rebuild the kernels in
    turn (most of a minute each on two busy cores), each taking the other's build for stale."""
    return without_own_header(source.read_text())


def without_own_header(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if line.strip() != OWN_HEADER)


def compile_kernels(name: str, texts: list[str], march: str,
                    functions: list[str] = FUNCTIONS) -> ModuleType:
    """Build (or load from the cache) the sources' `texts` as extension `name` for `march`,
    binding `functions` (another revision's sources may define fewer)."""
    from torch.utils.cpp_extension import load_inline

    return load_inline(  # type: ignore[no-untyped-call,no-any-return]
        name=name, cpp_sources=[BINDING_HEADERS, *texts], functions=functions,
        extra_cflags=["-O3", f"-march={march}", "-fopenmp"], extra_ldflags=["-fopenmp"],
        no_implicit_headers=True, verbose=False)


def build_name(machine: str, march: str, flags: Iterable[str]) -> str:
    """The cache name of a build for `march` on this machine: a native build is named by the
    CPU's flags too, so a CPU lacking one of them never loads it."""
    name = f"distserve_kernels_{machine}_{march.replace('-', '_')}"
    if march == "native":
        name += "_" + hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:12]
    return name


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The compiled module (`paged_decode_attention`, `quantized_matmul`, `float_matmul` and
    its `panel_width`, a layer's `rms_norm`, `silu_mul` and `rope`, a decode step's
    `decode_layers`, drawing tokens with `sample_rows` within a grammar's `mask_rows`), or
    None if it cannot be built."""
    march = os.environ.get("DS_KERNEL_MARCH", "native")
    name = build_name(platform.machine(), march, cpu_flags())
    try:
        with build_lock(name):
            return compile_kernels(name, [source_text(source) for source in SOURCES], march)
    except (OSError, RuntimeError, ImportError) as e:
        log.warning("CPU kernels unavailable (%s): decode attention takes the torch gather "
                    "path, float matmuls BLAS's, quantized weights are refused", e)
        return None
