"""The profiler's calibration on heartbeats, over a real nats-server and Valkey (its clock
injected): it asks for a new plan when the step times move far enough, but no sooner than
its cooldown after the last plan it asked for, so a calibration that swings with the load
does not replan the stack every few seconds; one the cooldown held back goes once it is
over."""

import asyncio
import time
from collections.abc import Callable

import pytest
from nats.aio.msg import Msg
from redis import Redis

from services.planner.calibration import Calibration
from services.planner.profiles import SHIPPED_PROFILES, load_profile, shipped_cpu_profile
from services.profiler.detector import RequestEvent
from services.profiler.service import ProfilerService, ProfilerSettings
from shared import subjects
from shared.bus import connect, publish
from shared.state import InstanceInfo
from tests.planner.test_calibration import recorded_steps

WAIT_S = 30.0  # generous: CI hosts are busy


async def until(ok: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def test_step_times_that_move_ask_for_a_plan_at_most_once_a_cooldown(
        nats_url: str, redis_url: str) -> None:
    # the generic profile named, not the one shipped for this host's CPU where there is one:
    # the steps below are made from the generic one, and how far they sit from the profile
    # must not depend on the host (on a CPU without a profile of its own they sat on it)
    settings = ProfilerSettings(nats_url=nats_url, redis_url=redis_url,
                                planner_profile=str(shipped_cpu_profile(1)),
                                profiler_cooldown_s=30.0, profiler_calibrate_every_s=0.0)
    service = ProfilerService(settings)
    assert service.calibrator is not None
    service.monitor.reference = [RequestEvent(0.0, 100, 10)]  # a plan was made
    now = [0.0]
    service.clock = lambda: now[0]
    handled = [0]
    on_heartbeat = service._on_heartbeat

    async def counted(msg: Msg) -> None:
        await on_heartbeat(msg)
        handled[0] += 1

    service._on_heartbeat = counted  # type: ignore[method-assign]

    async def scenario() -> list[int]:
        stop = asyncio.Event()
        served = asyncio.create_task(service.run(stop))
        nc = await connect(nats_url, "test")
        replans: list[Msg] = []

        async def replan(msg: Msg) -> None:
            replans.append(msg)

        await nc.subscribe(subjects.REPLAN, cb=replan)
        await nc.flush()
        await until(lambda: Redis.from_url(redis_url).get(subjects.ready_key("profiler"))
                    is not None, "the profiler")
        numbered = 0
        seen: list[int] = []

        async def beat(at: float, slower: float, n: int, asks: int) -> None:
            """A heartbeat at `at` on the profiler's clock with `n` new steps `slower` x the
            profile; `asks`: the replans asked for by then."""
            nonlocal numbered
            steps = [s.model_copy(update={"step": s.step + numbered})
                     for s in recorded_steps(slower, slower, n, seed=numbered)]
            numbered += n
            now[0] = at
            before = handled[0]
            await publish(nc, subjects.HEARTBEATS, InstanceInfo(
                instance_id="w-0", role="colocated", recent_steps=steps, steps=numbered,
                heartbeat_at=1000.0 + at))
            await until(lambda: handled[0] > before, "the heartbeat")
            await until(lambda: len(replans) >= asks, "a replan")
            await asyncio.sleep(0.2)  # (one that should not come, late)
            seen.append(len(replans))

        await beat(0.0, 1.3, 120, 1)  # the first measured: 1.3x off the profile
        moved = 1.3 * 1.6
        await beat(5.0, moved, 400, 1)  # moved 1.6x, but 5 s after the last plan
        await beat(20.0, moved, 30, 1)
        # the cooldown over, the next heartbeat asks, though it brought no new step (idle)
        await beat(31.0, moved, 0, 2)
        await beat(40.0, moved, 30, 2)  # planned on it: nothing moved since
        await nc.close()
        stop.set()
        await served
        return seen

    assert asyncio.run(scenario()) == [1, 1, 1, 2, 2]
    # what the planner reads when it plans again: the calibration as last saved
    saved = Redis.from_url(redis_url).get(subjects.CALIBRATION_KEY)
    assert saved is not None and b'"decode_steps"' in saved


def test_prefill_workers_steps_are_calibrated_against_their_own_dtypes_profile(
        nats_url: str, redis_url: str) -> None:
    """bfloat16 prefill workers (DS_PREFILL_DTYPE) whose steps take what the bfloat16 profile
    says (DS_PLANNER_PREFILL_PROFILE) calibrate the prefill phase at 1.0: the stack runs as
    profiled, so float32 colocated replicas keep their float32 price. Against the float32
    profile alone the same steps read as a faster host (the profiles' ratio) and would
    price float32 prefills as fast as bfloat16 ones."""
    zen5 = SHIPPED_PROFILES / "smollm2-135m-cpu-1thread-amd-epyc-zen5"
    fp32, bf16 = f"{zen5}.json", f"{zen5}-bfloat16.json"
    prefill_steps = recorded_steps(1.0, 1.0, 120, latency=load_profile(bf16).latency(1, 1))
    decode_steps = recorded_steps(1.0, 1.0, 120, seed=1, latency=load_profile(fp32).latency(1, 1))

    async def calibrated(prefill_profile: str) -> Calibration:
        service = ProfilerService(ProfilerSettings(
            nats_url=nats_url, redis_url=redis_url, planner_profile=fp32,
            planner_prefill_profile=prefill_profile, profiler_calibrate_every_s=0.0))
        assert service.calibrator is not None
        stop = asyncio.Event()
        served = asyncio.create_task(service.run(stop))
        nc = await connect(nats_url, "test")
        await until(lambda: Redis.from_url(redis_url).get(subjects.ready_key("profiler"))
                    is not None, "the profiler")
        for role, steps in (("prefill", [s for s in prefill_steps if s.prompts]),
                            ("decode", [s for s in decode_steps if not s.prompts])):
            await publish(nc, subjects.HEARTBEATS, InstanceInfo(
                instance_id=f"{role}-0", role=role, recent_steps=steps, steps=len(steps),
                heartbeat_at=1000.0))
        await until(lambda: service.calibration.prefill_steps == 40
                    and service.calibration.decode_steps == 80, "both roles' steps")
        await nc.close()
        stop.set()
        await served
        return service.calibration

    own = asyncio.run(calibrated(bf16))
    assert own.prefill == pytest.approx(1.0, rel=0.03)
    assert own.decode == pytest.approx(1.0, rel=0.03)
    ratio = load_profile(bf16).latency(1, 1).prefill_latency_s(300, 300 * 300) / \
        load_profile(fp32).latency(1, 1).prefill_latency_s(300, 300 * 300)
    assert ratio < 0.9
    Redis.from_url(redis_url).delete(subjects.CALIBRATION_KEY)
    alone = asyncio.run(calibrated(""))
    assert alone.prefill == pytest.approx(ratio, rel=0.06)
