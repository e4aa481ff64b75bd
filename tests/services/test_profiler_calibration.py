"""The profiler's calibration on heartbeats (its NATS and Redis faked, its clock injected):
it asks for a new plan when the step times move far enough, but no sooner than its cooldown
after the last plan it asked for, so a calibration that swings with the load does not
replan the stack every few seconds; one the cooldown held back goes once it is over."""

import asyncio
from typing import Any

from services.profiler.detector import RequestEvent
from services.profiler.service import ProfilerService, ProfilerSettings
from shared import subjects
from shared.state import InstanceInfo
from tests.planner.test_calibration import recorded_steps


class Published:
    def __init__(self) -> None:
        self.subjects: list[str] = []

    async def publish(self, subject: str, data: bytes, headers: Any = None) -> None:
        self.subjects.append(subject)


class Kept:
    async def set(self, key: str, value: Any) -> None:
        pass


class Heartbeat:
    def __init__(self, info: InstanceInfo) -> None:
        self.data = info.model_dump_json().encode()


def test_step_times_that_move_ask_for_a_plan_at_most_once_a_cooldown() -> None:
    settings = ProfilerSettings(profiler_cooldown_s=30.0, profiler_calibrate_every_s=0.0)
    service = ProfilerService(settings)
    assert service.calibrator is not None
    bus = Published()
    service.nc, service.redis = bus, Kept()  # type: ignore[assignment]
    service.monitor.reference = [RequestEvent(0.0, 100, 10)]  # a plan was made
    now = [0.0]
    service.clock = lambda: now[0]
    numbered = 0

    def beat(at: float, slower: float, n: int) -> list[str]:
        nonlocal numbered
        steps = [s.model_copy(update={"step": s.step + numbered})
                 for s in recorded_steps(slower, slower, n, seed=numbered)]
        numbered += n
        now[0] = at
        info = InstanceInfo(instance_id="w-0", role="colocated", recent_steps=steps,
                            steps=numbered, heartbeat_at=1000.0 + at)
        before = len(bus.subjects)
        asyncio.run(service._on_heartbeat(Heartbeat(info)))  # type: ignore[arg-type]
        return bus.subjects[before:]

    assert beat(0.0, 1.0, 120) == [subjects.REPLAN]  # the first measured: off the profile
    assert beat(5.0, 1.6, 400) == []  # moved 1.6x, but 5 s after the last plan
    assert beat(20.0, 1.6, 30) == []
    # the cooldown over, the next heartbeat asks, though it brought no new step (idle)
    assert beat(31.0, 1.6, 0) == [subjects.REPLAN]
    assert beat(40.0, 1.6, 30) == []  # planned on it: nothing moved since
