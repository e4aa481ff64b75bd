"""Hand-written CPU kernels, compiled on first use with torch's C++ extension builder and
cached (TORCH_EXTENSIONS_DIR). Where no compiler is available the engine keeps its pure
torch path and logs why."""

from __future__ import annotations

import functools
import logging
import platform
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("paged_attention.cpp")


@functools.cache
def paged_attention() -> ModuleType | None:
    """The compiled module with `paged_decode_attention`, or None if it cannot be built."""
    from torch.utils.cpp_extension import load_inline

    try:
        return load_inline(  # type: ignore[no-untyped-call,no-any-return]
            # -march=native code must not be reused on another CPU: name it by the machine
            name=f"distserve_paged_attention_{platform.machine()}",
            cpp_sources=[SOURCE.read_text()],
            functions=["paged_decode_attention"],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except (OSError, RuntimeError, ImportError) as e:
        log.warning("paged attention kernel unavailable (%s); using the torch gather path", e)
        return None
