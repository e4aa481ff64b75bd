"""Loaded by every Python process of a test stack whose PYTHONPATH holds this folder: a
worker (DS_INSTANCE_ID set) whose id a test writes to DS_TEST_WEDGE_FILE wedges its engine
thread in the next step, for good, with the GIL released (as a native kernel, or an export
or import of KV, that never returns): its event loop and heartbeats go on."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

_FILE = os.environ.get("DS_TEST_WEDGE_FILE")
_ME = os.environ.get("DS_INSTANCE_ID")

if _FILE and _ME:
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the checkout
    from shared.engine.engine import Engine

    _step = Engine.step

    def _wanted() -> bool:
        try:
            return Path(_FILE).read_text().split() == [_ME]
        except OSError:
            return False

    def step(self: Engine) -> object:
        if _wanted():
            threading.Event().wait()  # never set
        return _step(self)

    Engine.step = step  # type: ignore[method-assign]
