"""Hand-written CPU kernels, compiled on first use with torch's C++ extension builder and
cached (TORCH_EXTENSIONS_DIR). Where no compiler is available the engine keeps its pure
torch path and logs why.

torch marks a build in progress with a lock file that only the builder removes: a process
killed mid-build (a worker restarted by its supervisor) leaves it, and every later process
waits on it forever. So builds here are serialised by an advisory lock the kernel drops
when its holder dies; whoever holds it knows any torch lock file left is stale."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import platform
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("paged_attention.cpp")


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


@functools.cache
def paged_attention() -> ModuleType | None:
    """The compiled module with `paged_decode_attention`, or None if it cannot be built."""
    from torch.utils.cpp_extension import load_inline

    # -march=native code must not be reused on another CPU: name it by the machine
    name = f"distserve_paged_attention_{platform.machine()}"
    try:
        with build_lock(name):
            return load_inline(  # type: ignore[no-untyped-call,no-any-return]
                name=name,
                cpp_sources=[SOURCE.read_text()],
                functions=["paged_decode_attention"],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
    except (OSError, RuntimeError, ImportError) as e:
        log.warning("paged attention kernel unavailable (%s); using the torch gather path", e)
        return None
