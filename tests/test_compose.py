"""docker-compose.yml cannot run here (no Docker engine): check that it parses and agrees
with the launcher (same service modules and commands) and with the services' settings, that
NATS and Valkey take the passwords of .env that the services' URLs carry, and that only the
gateway and Jaeger's UI are published, on 127.0.0.1."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.gateway.app import GatewaySettings
from services.launcher import NATS_USER
from services.launcher import module as launcher_module
from services.planner.service import PlannerSettings
from services.process import WorkerSettings
from services.profiler.service import ProfilerSettings

ROOT = Path(__file__).parents[1]
VARIABLE = re.compile(r"\$\{(\w+)(?:(:?)([-?])([^}]*))?\}")
SECRETS = {"DS_NATS_PASSWORD": "nats-pw", "DS_REDIS_PASSWORD": "redis-pw", "DS_API_KEYS": "k1,k2"}
OPTIONS = {"DS_MODEL", "DS_SERVED_MODEL_NAME", "DS_MODELS_DIR", "DS_PREFILL_WEIGHTS",
           "DS_DECODE_WEIGHTS", "DS_PREFILL_DTYPE", "DS_DECODE_DTYPE", "DS_PREFILL_TP",
           "DS_DECODE_TP", "DS_PREFILL_PP", "DS_DECODE_PP", "DS_STEP_TIMEOUT_S",
           "DS_HANG_TIMEOUT_S", "DS_CORS_ORIGINS"}  # empty in .env: defaults


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR-default}, ${VAR?error} and their ':' forms (empty = unset)."""
    def value(m: re.Match[str]) -> str:
        name, colon, op, arg = m.groups()
        if name in env and not (colon and env[name] == ""):
            return env[name]
        if op == "?":
            raise KeyError(f"compose refuses to start: {arg}")
        return arg or ""

    return VARIABLE.sub(value, text)


def interpolated(node: object, env: dict[str, str]) -> object:
    """Compose interpolates the parsed file's strings (so an empty value stays a string)."""
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [interpolated(item, env) for item in node]
    if isinstance(node, dict):
        return {key: interpolated(value, env) for key, value in node.items()}
    return node


def compose(env: dict[str, str] = SECRETS) -> dict[str, dict[str, object]]:
    services = interpolated(yaml.safe_load((ROOT / "docker-compose.yml").read_text()), env)
    assert isinstance(services, dict)
    return dict(services["services"])


def launcher_commands() -> dict[str, list[str]]:
    """The modules the launcher starts, read from its source of truth."""
    source = (ROOT / "services" / "launcher.py").read_text()
    assert launcher_module("decode") == [sys.executable, "-m", "services.decode"]
    assert 'module(role), worker_env(' in source
    assert 'module("gateway")' in source
    assert 'module("profiler")' in source and 'module("planner")' in source
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
    # and the hang timeout, which services.liveness reads for every process it watches
    worker = {f"DS_{f.upper()}" for f in WorkerSettings.model_fields} | {"DS_HANG_TIMEOUT_S"}
    gateway = {f"DS_{f.upper()}" for f in GatewaySettings.model_fields}
    profiler = {f"DS_{f.upper()}" for f in ProfilerSettings.model_fields}
    planner = {f"DS_{f.upper()}" for f in PlannerSettings.model_fields}
    for name, known in (("prefill", worker), ("decode", worker), ("gateway", gateway),
                        ("profiler", profiler), ("planner", planner)):
        env = compose()[name]["environment"]
        assert isinstance(env, dict)
        names = {k for k in env if k.startswith("DS_")}
        assert names and names <= known, names - known
        assert env["DS_NATS_URL"] == f"nats://{NATS_USER}:nats-pw@nats:4222"
        assert env["DS_REDIS_URL"] == "redis://:redis-pw@redis:6379"


def test_nats_and_valkey_take_the_passwords_the_services_use() -> None:
    services = compose()
    assert services["nats"]["command"] == ["--user", NATS_USER, "--pass", "nats-pw"]
    command = services["redis"]["command"]
    assert isinstance(command, list)
    assert command[command.index("--requirepass") + 1] == "redis-pw"
    for name in ("DS_NATS_PASSWORD", "DS_REDIS_PASSWORD"):
        with pytest.raises(KeyError, match=rf"set {name} in \.env"):
            compose({**SECRETS, name: ""})


def test_only_the_gateway_gets_the_api_keys() -> None:
    for name, service in compose().items():
        env = service.get("environment", {})
        assert isinstance(env, dict)
        assert env.get("DS_API_KEYS") == ("k1,k2" if name == "gateway" else None), name
    open_api = compose({**SECRETS, "DS_API_KEYS": ""})["gateway"]["environment"]
    assert isinstance(open_api, dict) and open_api["DS_API_KEYS"] == ""
    with pytest.raises(KeyError, match=r"set DS_API_KEYS in \.env"):
        compose({k: v for k, v in SECRETS.items() if k != "DS_API_KEYS"})


def test_env_example_names_every_variable_compose_reads() -> None:
    used = set(VARIABLE.findall((ROOT / "docker-compose.yml").read_text()))
    lines = (ROOT / ".env.example").read_text().splitlines()
    example = dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))
    assert {name for name, *_ in used} == set(example) == set(SECRETS) | OPTIONS
    assert not any(example.values())  # no default secret anyone could copy


def test_the_model_is_the_built_in_one_or_a_directory_mounted_at_models() -> None:
    services = compose()
    for name in ("prefill", "decode", "gateway", "planner"):
        env = services[name]["environment"]
        assert isinstance(env, dict) and env["DS_MODEL"] == "smollm2-135m"
        assert services[name]["volumes"] == ["./models:/models:ro"]
    mine = compose({**SECRETS, "DS_MODEL": "/models/Qwen3-0.6B", "DS_MODELS_DIR": "/srv/m"})
    for name in ("prefill", "decode", "gateway", "planner"):
        env = mine[name]["environment"]
        assert isinstance(env, dict) and env["DS_MODEL"] == "/models/Qwen3-0.6B"
        assert mine[name]["volumes"] == ["/srv/m:/models:ro"]


def test_only_the_gateway_and_jaegers_ui_are_published_on_loopback() -> None:
    services = compose()
    published = {name: s["ports"] for name, s in services.items() if "ports" in s}
    assert published == {"gateway": ["127.0.0.1:8000:8000"],
                         "jaeger": ["127.0.0.1:16686:16686"]}
    for ports in published.values():
        assert isinstance(ports, list)
        assert all(str(port).startswith("127.0.0.1:") for port in ports)
    assert not any("network_mode" in s for s in services.values())  # host: every port


def test_service_modules_start() -> None:
    """Each service module at least imports and finds its settings (no servers needed), each
    in a fresh interpreter (an import cycle shows only when its module comes first), all at
    once: one after another they took 33 s, each loading torch."""
    modules = ["services.prefill.service", "services.decode.service",
               "services.colocated.service", "services.gateway.routes",
               "services.profiler.service", "services.planner.service"]
    started = {m: subprocess.Popen([sys.executable, "-c", f"import {m}"], cwd=ROOT, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
               for m in modules}
    for module, process in started.items():
        _, err = process.communicate(timeout=300)
        assert process.returncode == 0, f"{module}: {err}"


def test_every_container_comes_back_when_it_exits() -> None:
    """As `distserve up`'s supervisor brings its children back: a crashed worker, or one that
    left because its engine wedged (no supervisor watches its alive file here), restarts."""
    for name, service in compose().items():
        assert service.get("restart") == "unless-stopped", name
