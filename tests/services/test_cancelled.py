"""The memory of cancelled requests (pure, an injected clock)."""

from __future__ import annotations

from services.cancelled import Cancelled


def test_a_cancel_is_remembered_for_its_time_then_forgotten() -> None:
    now = [0.0]
    cancelled = Cancelled(keep_s=10.0, clock=lambda: now[0])
    cancelled.add("a")
    now[0] = 6.0
    cancelled.add("b")
    assert "a" in cancelled and "b" in cancelled and "c" not in cancelled
    now[0] = 10.5
    assert "a" not in cancelled and "b" in cancelled and len(cancelled) == 1
    cancelled.add("b")  # again: its time starts over
    now[0] = 20.0
    assert "b" in cancelled
    now[0] = 21.0
    assert len(cancelled) == 0


def test_the_memory_is_bounded_and_drops_the_oldest_first() -> None:
    now = [0.0]
    cancelled = Cancelled(keep_s=1e9, most=3, clock=lambda: now[0])
    for i in range(5):
        now[0] = float(i)
        cancelled.add(f"r{i}")
    assert len(cancelled) == 3
    assert [f"r{i}" in cancelled for i in range(5)] == [False, False, True, True, True]


def test_a_move_cancels_the_attempts_up_to_its_own_and_the_client_all_of_them() -> None:
    cancelled = Cancelled()
    cancelled.add("moved", up_to=2)  # moved away from this instance at its attempt 2
    assert cancelled.covers("moved", 0) and cancelled.covers("moved", 2)
    assert not cancelled.covers("moved", 3)  # a later attempt may come back here
    assert "moved" not in cancelled  # not every attempt
    cancelled.add("moved", up_to=1)  # an older move's cancel, late: 2 still covered
    assert cancelled.covers("moved", 2) and not cancelled.covers("moved", 3)
    cancelled.add("moved")  # then the client went away
    assert cancelled.covers("moved", 99) and "moved" in cancelled
    cancelled.add("moved", up_to=5)
    assert cancelled.covers("moved", 99)  # every attempt, still
    assert not cancelled.covers("never", 0)
