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
