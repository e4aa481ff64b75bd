"""The planner service against real nats-server and Valkey: one restarted (crashed, or
killed, which kills the workers it deployed with it) plans again at once for the workload of
the last plan it stored, so its deployer starts what is missing."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from redis.asyncio import Redis

from services.planner.service import PlannerService, PlannerSettings
from shared import subjects
from shared.messages import WorkloadSummary

pytestmark = pytest.mark.timeout(120)


def settings(nats_url: str, redis_url: str, restarts: int) -> PlannerSettings:
    return PlannerSettings(nats_url=nats_url, redis_url=redis_url, planner_deployer="none",
                           planner_devices=2, planner_modes="disaggregated,colocated",
                           restarts=restarts)


async def plans(redis: Redis) -> list[dict[str, object]]:
    return [json.loads(t) for t in await redis.lrange(subjects.PLAN_HISTORY_KEY, 0, -1)]


@pytest.mark.parametrize(("stored", "restarts"), [(True, 1), (False, 1), (True, 0)])
def test_a_restarted_planner_plans_again_for_the_last_plans_workload(
        nats_url: str, redis_url: str, stored: bool, restarts: int) -> None:
    """Restarted, it plans for the last plan's workload; with no plan stored, or started
    with its stack (a Redis may hold another stack's plan), it waits for a workload."""
    workload = WorkloadSummary(rate_rps=0.5, arrival_cv=1.0, prompt_tokens=[200, 300, 250],
                               output_tokens=[40, 60, 50])

    async def main() -> None:
        redis = Redis.from_url(redis_url)
        if stored:  # what the last incarnation saved with its last plan
            await redis.set(subjects.PLAN_KEY, json.dumps({"inputs": workload.model_dump(),
                                                           "reasons": ["shift"]}))
        planner = PlannerService(settings(nats_url, redis_url, restarts))
        stop = asyncio.Event()
        resumes = stored and restarts > 0
        running = asyncio.create_task(planner.run(stop))
        deadline = time.monotonic() + 60
        while not (made := await plans(redis)) and resumes:
            assert time.monotonic() < deadline, "no plan was made after the restart"
            await asyncio.sleep(0.1)
        if not resumes:  # nothing to plan for until a workload is seen
            await asyncio.sleep(2.0)
        stop.set()
        await asyncio.wait_for(running, 30)
        if resumes:
            (plan,) = made
            assert plan["reasons"] == ["the planner restarted"]
            assert plan["inputs"] == workload.model_dump()
            assert planner.last_workload == workload
        else:
            assert made == [] and planner.last_workload is None
        await redis.aclose()

    asyncio.run(main())
