"""The launcher starts the planner's workers (services.spawner): asked over a real
nats-server by the planner's deployer, it starts them as its own children in their kind's
environment (a role's shape `up` fixed stays), says which are starting and which have
exited, stops them; it refuses a worker larger than the budget, past its cap, once the
stack stops, and a request that is not one, and touches no child it did not start. A
deployer waits for workers started before it (by a planner since killed). (That such a
worker outlives a killed planner: tests/services/test_replanning.py.)"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from redis.asyncio import Redis

from services.planner.budget import Shape
from services.planner.deployer import DeployError, LauncherWorkers, LocalDeployer, WorkerStarter
from services.spawner import Spawner
from services.supervisor import Supervisor
from shared import subjects
from shared.bus import connect
from shared.messages import StartedWorker
from shared.state import Registry


def test_the_launcher_starts_reports_and_stops_only_the_planners_workers(
        nats_url: str, redis_url: str, tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path)
    # its workers exit as they start, saying why (a setting they refuse)
    base = {**os.environ, "DS_KV_CACHE_MB": "nonsense", "DS_NATS_URL": nats_url,
            "DS_TP": "", "DS_COLOCATED_TP": "2"}
    gateway = supervisor.spawn("gateway", ["sleep", "120"])
    spawner = Spawner(WorkerStarter(supervisor, base), nats_url, budget=2)
    spawner.start()

    async def scenario() -> None:
        nc = await connect(nats_url, "planner")
        hands = LauncherWorkers(nc)
        name = await hands.start("decode", Shape(tp=1, pp=2))
        assert name.startswith("decode-")
        # the launcher's child, in its kind's environment and the plan's shape
        (child,) = [c for c in supervisor.children if c.name == name]
        assert child.env is not None
        env = child.env(0)
        assert (env["DS_TP"], env["DS_PP"], env["DS_INSTANCE_ID"]) == ("1", "2", name)
        assert env["DS_KV_CACHE_MB"] == "nonsense" and "DS_CHUNKED_PREFILL" not in env
        # a role whose tp `up` set keeps it, whatever shape is asked
        plain = await hands.start("chunked", Shape(tp=1, pp=2))
        (second,) = [c for c in supervisor.children if c.name == plain]
        assert second.env is not None and second.env(0)["DS_TP"] == "2"
        assert "DS_PP" not in second.env(0) and second.env(0)["DS_CHUNKED_PREFILL"] == "true"
        assert sorted(await hands.starting()) == sorted([name, plain])
        deadline = time.monotonic() + 120
        while len(await hands.exited([name, plain, "gateway"])) < 2:
            assert time.monotonic() < deadline, "the workers never exited"
            await asyncio.sleep(0.5)
        assert sorted(await hands.exited([name, plain, "gateway"])) == sorted([name, plain])
        assert await hands.starting() == []  # restarted since: crashed
        await hands.stop([name, plain, "gateway"])
        assert {c.name for c in supervisor.children} == {"gateway"}
        assert gateway.poll() is None  # not one it started: untouched

        # the planner's deployer through it: a worker that crashes while starting fails
        # the deployment and is stopped
        redis = Redis.from_url(redis_url)
        deployer = LocalDeployer(nc, Registry(redis), hands, health_timeout_s=120)
        with pytest.raises(DeployError, match="exited while starting"):
            await deployer.apply({"colocated": 1})
        assert {c.name for c in supervisor.children} == {"gateway"}
        # a deployer of a planner restarted meanwhile waits for the worker started before it
        await hands.start("prefill", None)
        with pytest.raises(DeployError, match="exited while starting"):
            await LocalDeployer(nc, Registry(redis), hands, health_timeout_s=120).apply({})
        assert {c.name for c in supervisor.children} == {"gateway"}

        with pytest.raises(DeployError, match="more than the planner's budget of 2"):
            await hands.start("decode", Shape(tp=3, pp=1))
        spawner.most = 0
        with pytest.raises(DeployError, match="run 0 ranks at most"):
            await hands.start("decode", None)
        reply = await nc.request(subjects.LAUNCHER_START, b'{"kind": "gateway"}', timeout=10)
        assert "not a StartWorker" in StartedWorker.model_validate_json(reply.data).error
        spawner.close()  # the stack stops
        spawner.most = 8
        with pytest.raises(DeployError, match="the stack is stopping"):
            await hands.start("decode", None)
        assert {c.name for c in supervisor.children} == {"gateway"}
        await redis.aclose()
        await nc.close()

    try:
        asyncio.run(scenario())
    finally:
        spawner.join()
        supervisor.stop()


def test_a_planner_gets_a_deploy_error_where_no_launcher_answers(nats_url: str) -> None:
    async def scenario() -> None:
        nc = await connect(nats_url, "planner")
        with pytest.raises(DeployError, match="the launcher did not answer"):
            await LauncherWorkers(nc, timeout_s=2).start("decode", None)
        await nc.close()

    asyncio.run(scenario())
