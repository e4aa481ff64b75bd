"""The shift detector on synthetic streams (pure, milliseconds)."""

from __future__ import annotations

import numpy as np

from services.profiler.detector import (
    DetectorConfig,
    RequestEvent,
    WindowStats,
    WorkloadMonitor,
    detect,
)
from services.profiler.service import summary

CONFIG = DetectorConfig(window=60, cooldown_s=0.0)


def stream(n: int, rate: float, prompt_median: float, rng: np.random.Generator,
           start: float = 0.0) -> list[RequestEvent]:
    times = start + np.cumsum(rng.exponential(1 / rate, n))
    prompts = np.maximum(1, rng.lognormal(np.log(prompt_median), 0.8, n)).astype(int)
    outputs = np.maximum(1, rng.lognormal(np.log(100), 0.8, n)).astype(int)
    return [RequestEvent(float(t), int(p), int(o))
            for t, p, o in zip(times, prompts, outputs, strict=True)]


def feed(monitor: WorkloadMonitor, events: list[RequestEvent]) -> list[tuple[int, object]]:
    flagged = []
    for i, e in enumerate(events):
        shift = monitor.observe(e, e.arrival_s)
        if shift is not None:
            flagged.append((i, shift))
    return flagged


def test_a_tripled_rate_is_flagged_within_a_window() -> None:
    rng = np.random.default_rng(0)
    before = stream(300, 2.0, 200, rng)
    after = stream(300, 6.0, 200, rng, start=before[-1].arrival_s)
    monitor = WorkloadMonitor(CONFIG)
    flagged = feed(monitor, before + after)
    assert flagged[0][0] == CONFIG.window - 1  # the first full window: the reference
    (index, shift), = flagged[1:]
    assert 300 <= index < 300 + CONFIG.window  # detected before a window of the new rate
    assert any("arrival rate" in r for r in shift.reasons)  # type: ignore[attr-defined]
    assert shift.recent.rate_rps > 2 * shift.reference.rate_rps  # type: ignore[attr-defined]


def test_longer_prompts_are_flagged_within_a_window() -> None:
    rng = np.random.default_rng(1)
    before = stream(300, 2.0, 100, rng)
    after = stream(300, 2.0, 500, rng, start=before[-1].arrival_s)
    flagged = feed(WorkloadMonitor(CONFIG), before + after)
    (index, shift), = flagged[1:]
    assert 300 <= index < 300 + CONFIG.window
    assert shift.reasons[0].startswith("prompt lengths changed")  # type: ignore[attr-defined]
    # flagged early: the window that flags it still holds some of the old prompts
    assert shift.recent.prompt_p90 > 3 * shift.reference.prompt_p90  # type: ignore[attr-defined]


def test_a_stationary_stream_raises_no_false_alarm_over_many_windows() -> None:
    rng = np.random.default_rng(2)
    events = stream(200 * CONFIG.window, 3.0, 300, rng)  # 200 windows, tested at every event
    flagged = feed(WorkloadMonitor(CONFIG), events)
    assert len(flagged) == 1 and flagged[0][0] == CONFIG.window - 1  # only the reference


def test_cooldown_stops_flapping() -> None:
    rng = np.random.default_rng(3)
    a = stream(200, 2.0, 100, rng)
    b = stream(200, 2.0, 600, rng, start=a[-1].arrival_s)
    c = stream(200, 2.0, 100, rng, start=b[-1].arrival_s)
    quick = feed(WorkloadMonitor(CONFIG), a + b + c)
    assert len(quick) == 3  # reference, longer, shorter again
    slow = feed(WorkloadMonitor(DetectorConfig(window=60, cooldown_s=1e6)), a + b + c)
    assert len(slow) == 1  # only the reference: every later change falls in the cool-down
    assert [i for i, _ in quick] == sorted(i for i, _ in quick)
    assert 200 <= quick[1][0] < 260 and 400 <= quick[2][0] < 460


def test_detect_is_quiet_on_equal_windows_and_names_each_change() -> None:
    rng = np.random.default_rng(4)
    ref = stream(100, 2.0, 200, rng)
    assert detect(ref, stream(100, 2.0, 200, rng), CONFIG) == ()
    both = detect(ref, stream(100, 8.0, 800, rng), CONFIG)
    assert len(both) == 2 and "prompt" in both[0] and "rate" in both[1]


def test_a_summary_carries_each_requests_cached_tokens_with_its_lengths() -> None:
    events = [RequestEvent(float(i), 100, 10, 96 if i % 2 else 0) for i in range(10)]
    planned = summary(events, WindowStats.of(events))
    assert planned.cached_tokens == [0, 96] * 5 and planned.prompt_tokens == [100] * 10
