"""The compiled kernel survives a build killed half-way: a later process does not wait
forever on the lock file the killed builder left."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

LOAD = """
from torch.utils.cpp_extension import _get_build_directory
from shared.engine.kernels import paged_attention
print(paged_attention() is not None)
"""


@pytest.mark.timeout(900)
def test_a_stale_build_lock_is_removed_not_waited_on() -> None:
    from torch.utils.cpp_extension import _get_build_directory

    name = f"distserve_paged_attention_{platform.machine()}"
    subprocess.run([sys.executable, "-c", LOAD], check=True, timeout=800)  # built, cached
    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    lock.touch()  # what a builder killed mid-build leaves behind
    done = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True,
                          timeout=300)  # torch alone would wait on it for ever
    assert done.stdout.strip() == "True", done.stderr
    assert "left by a build that was killed" in done.stderr
    assert not lock.exists()
