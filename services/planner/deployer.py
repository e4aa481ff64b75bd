"""Deployers apply a plan's instance counts. The local one starts prefill/decode worker
processes on this host and drains the ones no longer needed; scaling up completes (the new
instances heartbeat, so the gateway dispatches to them) before anything is drained."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Protocol

from nats.aio.client import Client

from shared import subjects
from shared.bus import publish
from shared.messages import Drain
from shared.state import InstanceInfo, Registry, Role

log = logging.getLogger(__name__)
ROLES: tuple[Role, Role] = ("prefill", "decode")


class DeployError(RuntimeError):
    pass


class Deployer(Protocol):
    async def apply(self, counts: dict[Role, int]) -> dict[str, list[str]]: ...

    def stop(self) -> None: ...


def to_drain(live: list[InstanceInfo], want: int) -> list[InstanceInfo]:
    """The least-loaded instances beyond `want` (they finish soonest)."""
    extra = max(0, len(live) - want)
    by_load = sorted(live, key=lambda i: (i.running + i.queue_len, i.instance_id))
    return by_load[:extra]


class LogOnlyDeployer:
    """Records plans without acting (e.g. under docker-compose, where an orchestrator
    scales the containers)."""

    async def apply(self, counts: dict[Role, int]) -> dict[str, list[str]]:
        log.info("plan (not applied): %s", counts)
        return {"started": [], "drained": []}

    def stop(self) -> None:
        pass


class LocalDeployer:
    def __init__(self, nc: Client, registry: Registry, run_dir: str | None,
                 health_timeout_s: float = 300.0) -> None:
        self.nc, self.registry, self.run_dir = nc, registry, run_dir
        self.health_timeout_s = health_timeout_s
        self.children: dict[str, subprocess.Popen[bytes]] = {}

    async def live(self) -> dict[Role, list[InstanceInfo]]:
        return {role: [i for i in await self.registry.instances(role) if not i.draining]
                for role in ROLES}

    async def apply(self, counts: dict[Role, int]) -> dict[str, list[str]]:
        live = await self.live()
        started = [self._spawn(role) for role in ROLES
                   for _ in range(counts[role] - len(live[role]))]
        if started:
            await self._wait_healthy(started)
        drained = [i.instance_id for role in ROLES for i in to_drain(live[role], counts[role])]
        for instance in drained:
            await publish(self.nc, subjects.drain(instance), Drain(reason=f"plan {counts}"))
        if started or drained:
            log.info("applied %s: started %s, draining %s", counts, started, drained)
        return {"started": started, "drained": drained}

    def _spawn(self, role: Role) -> str:
        instance = f"{role}-{uuid.uuid4().hex[:6]}"
        logs = Path(self.run_dir or ".")
        logs.mkdir(parents=True, exist_ok=True)
        with (logs / f"{instance}.log").open("wb") as out:  # the child keeps its own handle
            self.children[instance] = subprocess.Popen(
                [sys.executable, "-m", f"services.{role}"], stdout=out,
                stderr=subprocess.STDOUT, env={**os.environ, "DS_INSTANCE_ID": instance})
        log.info("started %s", instance)
        return instance

    async def _wait_healthy(self, instances: list[str]) -> None:
        deadline = time.monotonic() + self.health_timeout_s
        while time.monotonic() < deadline:
            for instance in instances:
                code = self.children[instance].poll()
                if code is not None:
                    raise DeployError(f"{instance} exited with code {code} while starting")
            ready = {i.instance_id for role in ROLES for i in await self.registry.instances(role)}
            if ready.issuperset(instances):
                return
            await asyncio.sleep(0.5)
        raise DeployError(f"{instances} not healthy within {self.health_timeout_s:.0f}s")

    def stop(self, grace: float = 15.0) -> None:
        """Stop (drain) the workers this deployer started."""
        for proc in self.children.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.children.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
