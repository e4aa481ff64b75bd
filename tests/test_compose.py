"""docker-compose.yml cannot run here (no Docker engine): check that it parses and agrees
with the launcher (same service modules and commands) and with the services' settings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from services.gateway.app import GatewaySettings
from services.planner.service import PlannerSettings
from services.profiler.service import ProfilerSettings
from services.runtime import WorkerSettings

ROOT = Path(__file__).parents[1]


def compose() -> dict[str, dict[str, object]]:
    data = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return dict(data["services"])


def launcher_commands() -> dict[str, list[str]]:
    """The modules the launcher starts, read from its source of truth."""
    source = (ROOT / "services" / "launcher.py").read_text()
    assert '[sys.executable, "-m", f"services.{role}"]' in source
    assert '[sys.executable, "-m", "services.gateway"]' in source
    assert '[sys.executable, "-m", f"services.{service}"]' in source
    assert 'for service in ("profiler", "planner")' in source
    return {name: ["python", "-m", f"services.{name}"]
            for name in ("prefill", "decode", "gateway", "profiler", "planner")}


def test_compose_has_the_stack_and_the_launchers_commands() -> None:
    services = compose()
    assert {"nats", "redis", "gateway", "prefill", "decode", "jaeger", "profiler",
            "planner"} <= set(services)
    for name, command in launcher_commands().items():
        assert services[name]["command"] == command
        assert services[name]["build"] == "."
        module = command[-1].replace(".", "/")
        assert (ROOT / module / "__main__.py").exists()
    assert (ROOT / "Dockerfile").exists()


def test_compose_environment_names_real_settings() -> None:
    worker = {f"DS_{f.upper()}" for f in WorkerSettings.model_fields}
    gateway = {f"DS_{f.upper()}" for f in GatewaySettings.model_fields}
    profiler = {f"DS_{f.upper()}" for f in ProfilerSettings.model_fields}
    planner = {f"DS_{f.upper()}" for f in PlannerSettings.model_fields}
    for name, known in (("prefill", worker), ("decode", worker), ("gateway", gateway),
                        ("profiler", profiler), ("planner", planner)):
        env = compose()[name]["environment"]
        assert isinstance(env, dict)
        names = {k for k in env if k.startswith("DS_")}
        assert names and names <= known, names - known
        assert env["DS_NATS_URL"] == "nats://nats:4222"
        assert env["DS_REDIS_URL"] == "redis://redis:6379"


def test_service_modules_start() -> None:
    """Each service module at least imports and finds its settings (no servers needed)."""
    for module in ("services.prefill.service", "services.decode.service",
                   "services.colocated.service", "services.gateway.routes",
                   "services.profiler.service", "services.planner.service"):
        result = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
