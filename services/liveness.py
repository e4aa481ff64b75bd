"""The alive file: how a child shows its supervisor it is not hung, both sides.

The supervisor names a file per watched child (`DS_ALIVE_FILE`: `<name>.alive` beside its
log). The child touches it every second while it turns (`show_alive`), removes it as it
stops in order (`forget_alive`), and marks `<name>.leaving` beside it when asked to leave
(`mark_leaving`). The supervisor kills a child that has touched the file but left it
untouched for the hang timeout (`hang_timeout`; once it is being stopped, for 15 s at most:
`supervisor.STOPPING_HANG_S`), and brings back no child that was leaving.
A child not watched gets no file, and every call here does nothing for it, but a worker's
`leave_when_stuck`: with no one to kill it, it leaves itself past its step timeout, or with
its event loop held past the hang timeout."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_HANG_S = 60.0
HUNG = 70  # the exit code of a worker no supervisor watches whose engine stayed stuck
PAUSED_S = 5.0  # a watchdog's round of a second that took this long: the process was paused


def hang_timeout(env: Mapping[str, str]) -> float | None:
    """How long a watched child may leave its alive file untouched, and a worker no one
    watches its event loop unturned before it leaves (`leave_when_stuck`): DS_HANG_TIMEOUT_S
    in `env`, default 60 s; 0 (or a value that is not a positive number): never killed as
    hung, nor leaving for a held loop (a worker still leaves past DS_STEP_TIMEOUT_S).
    The heartbeats beat every 0.5 s, and a step, however long, holds neither them nor the
    loop (torch releases the GIL)."""
    try:
        value = float(env.get("DS_HANG_TIMEOUT_S", DEFAULT_HANG_S))
    except ValueError:
        log.warning("DS_HANG_TIMEOUT_S=%r is not a number: hung processes are not ended",
                    env["DS_HANG_TIMEOUT_S"])
        return None
    return value if 0 < value < float("inf") else None


def alive_file(log_path: Path) -> Path:
    """The alive file of the child logging to `log_path`."""
    return log_path.with_suffix(".alive")


def leaving_mark(alive: Path | str) -> Path:
    return Path(alive).with_suffix(".leaving")


def watched(env: Mapping[str, str] | None, alive: Path | None) -> Mapping[str, str] | None:
    """`env` (None: this process's) naming the alive file, where the child is watched; the
    last incarnation's file and leaving mark are removed, so a new one is not judged by
    them."""
    if alive is None:
        return env
    alive.unlink(missing_ok=True)
    leaving_mark(alive).unlink(missing_ok=True)
    return {**(os.environ if env is None else env), "DS_ALIVE_FILE": str(alive)}


async def show_alive(path: str, every_s: float = 1.0,
                     turning: Callable[[], bool] | None = None) -> None:
    """Touch `path` (where one is given) every `every_s` while this event loop runs and
    `turning()` says the process's main loop does too (it ticked since the last call): the
    supervisor kills a process that leaves it untouched for its hang timeout (stopped, or
    wedged with the GIL or its main loop held). The file stays when this ends: the process
    removes it as it stops in order (`forget_alive`), so one whose loop died of an error is
    judged by its silence."""
    if not path:
        return
    file = Path(path)
    while True:
        if turning is None or turning():
            with contextlib.suppress(OSError):
                file.touch()
        await asyncio.sleep(every_s)


def turning(ticks: Callable[[], int], busy_since: Callable[[], float], step_timeout_s: float,
            name: str = "", clock: Callable[[], float] = time.time) -> Callable[[], bool]:
    """What `show_alive` asks of a worker (from any thread): whether its main loop has ticked
    since the last call (`ticks()`: its count of turns), and its engine has not been at one
    thing longer than `step_timeout_s` (`busy_since()`: the wall-clock start of the step
    under way, its outputs not handled yet, or of the engine thread's call; 0: none). A loop
    held by a call that never returns is hung; so is one that turns while its engine never
    gets on (a kernel, an export or import of KV wedged on the engine thread, an output that
    is never handled): the supervisor kills it and brings it back, the gateway having moved
    its requests. 0: the engine is never timed out."""
    seen, told = -1, False

    def turned() -> bool:
        nonlocal seen, told
        now = ticks()
        moved, seen = now != seen, now
        started = busy_since()
        running_s = clock() - started if started > 0 else 0.0
        stuck = step_timeout_s > 0 and running_s > step_timeout_s
        if stuck and not told:
            log.error("%s: an engine step has run for %.0f s (DS_STEP_TIMEOUT_S=%g): hung, "
                      "no longer shown alive", name or "worker", running_s, step_timeout_s)
        told = stuck
        return moved and not stuck
    return turned


async def leave_when_stuck(stuck_since: Callable[[], float], step_timeout_s: float,
                           code: Callable[[], int], name: str,
                           ticks: Callable[[], int] | None = None, hang_s: float | None = None,
                           stopping: Callable[[], bool] = lambda: False, every_s: float = 1.0,
                           clock: Callable[[], float] = time.monotonic) -> None:
    """For a worker no supervisor watches (docker-compose, or DS_HANG_TIMEOUT_S=0: no alive
    file): exit with `code()` (`HUNG`; `DRAINED` once asked to leave) once its engine has
    been at the same step or call (`stuck_since()`, its wall-clock start; 0: none) for
    `step_timeout_s` (0: never), a kernel or KV transfer wedged with the GIL released, its
    event loop and heartbeats going on; or once its main loop has not turned (`ticks()`, its
    count of turns) for `hang_s` (None: never), held by a call that never returns while this
    thread beats on. Both are counted by this loop on the monotonic clock, a round that
    overslept (the process paused, the host suspended) counting for nothing; nothing once
    `stopping()` (the worker stops in order, and bounds its own wait for its engine). Its
    container's restart policy (or the supervisor) brings it back; the gateways have moved
    its requests. Under a supervisor the alive file does this (`turning`). A call that holds
    the GIL too holds this thread: only a supervisor catches that."""
    if step_timeout_s <= 0 and hang_s is None:
        return
    held, seen, last = 0.0, 0.0, clock()
    quiet, turns = 0.0, ticks() if ticks is not None else 0
    while True:
        await asyncio.sleep(every_s)
        if stopping():
            return
        now = clock()
        counted = now - last if now - last < PAUSED_S else 0.0
        last = now
        since = stuck_since()
        held = held + counted if since > 0 and since == seen else 0.0
        seen = since
        if ticks is not None:
            turned = ticks()
            quiet = quiet + counted if turned == turns else 0.0
            turns = turned
        if step_timeout_s > 0 and held > step_timeout_s:
            log.error("%s: an engine step has run for %.0f s (DS_STEP_TIMEOUT_S=%g) and no "
                      "supervisor watches this process: exiting with code %d", name, held,
                      step_timeout_s, code())
            break
        if hang_s is not None and quiet > hang_s:
            log.error("%s: its event loop has not turned for %.0f s (DS_HANG_TIMEOUT_S=%g) and "
                      "no supervisor watches this process: exiting with code %d", name, quiet,
                      hang_s, code())
            break
    exit_now(code())


def exit_now(code: int) -> None:
    """Leave at once, from any thread (the engine thread may be wedged in a call that never
    returns, so no orderly stop can finish)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def step_timeout_problem(step_timeout_s: float, collective_timeout_s: float,
                         ranks: int) -> str | None:
    """What is wrong with a worker's step timeout, or None: a tp/pp instance's first step
    may wait out the collective timeout for a rank still loading its weights, so a step
    timeout not above it takes that wait for a hung engine."""
    if ranks > 1 and 0 < step_timeout_s <= collective_timeout_s:
        return (f"DS_STEP_TIMEOUT_S ({step_timeout_s:g} s) is not above "
                f"DS_COLLECTIVE_TIMEOUT_S ({collective_timeout_s:g} s): a first step waiting "
                "for a rank still loading its weights may be taken for a hung engine")
    return None


def mark_leaving(path: str) -> None:
    """Asked to leave (a Drain message): beside the alive file, a mark that tells the
    supervisor not to bring this worker back whatever its end (hung or failed while
    draining, it would undo the drain)."""
    if path:
        with contextlib.suppress(OSError):
            leaving_mark(path).touch()


def forget_alive(path: str) -> None:
    """Stopping in order: not to be judged by a file no longer touched."""
    if path:
        Path(path).unlink(missing_ok=True)
