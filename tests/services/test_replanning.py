"""Draining and online replanning with real processes, NATS and Valkey: a drained decode
instance finishes what it holds; a workload whose prompts get much longer makes the
profiler flag a shift, the planner move capacity toward prefill and the local deployer
rescale; short prompts make the planner switch a disaggregated stack to chunked-prefill
replicas; a profile where tensor parallelism pays makes it reshape the prefill instance;
every request completes throughout."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from redis import Redis

from distserve.bench.loadgen import Target, run_requests
from distserve.bench.results import RunResult
from distserve.bench.workload import BenchRequest
from distserve.cli import main
from services.planner.budget import Shape
from services.planner.calibration import Calibration
from services.planner.decide import decide
from services.planner.profiles import load_profile, save_profile, shipped_cpu_profile
from services.planner.service import PlannerSettings
from services.supervisor import DRAINED
from shared import subjects
from shared.bus import connect, publish
from shared.host import machine_id
from shared.messages import Drain, ReplanRequest, WorkloadSummary
from tests.services.conftest import start_stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
MODEL = "smollm2-135m"


def requests(n: int, prompt: int, output: int, gap_s: float) -> list[BenchRequest]:
    return [BenchRequest(i, i * gap_s, list(range(1000 + i, 1000 + i + prompt)), prompt, output)
            for i in range(n)]


def in_background(target: Target, batch: list[BenchRequest]) -> tuple[threading.Thread,
                                                                      list[RunResult]]:
    out: list[RunResult] = []
    thread = threading.Thread(target=lambda: out.append(
        asyncio.run(run_requests(target, batch, 1.0))))
    thread.start()
    return thread, out


def served_across(target: Target, during: list[BenchRequest], deployed: Callable[[], bool],
                  what: str, after: list[BenchRequest], tokens: int) -> None:
    """`during` sent while the planner redeploys (until `deployed`, `what`), then `after`
    to the new workers: every request completes with its `tokens`."""
    thread, result = in_background(target, during)
    wait_for(deployed, 300, what)
    thread.join(timeout=300)
    early = result[0].records
    assert [r.error for r in early] == [None] * len(during)
    assert {r.tokens for r in early} == {tokens}
    late = asyncio.run(run_requests(target, after, 1.0)).records
    assert [r.error for r in late] == [None] * len(after) and {r.tokens for r in late} == {tokens}


def plan_history(redis: Redis) -> list[dict[str, Any]]:
    """The planner's records, newest first."""
    return [json.loads(h) for h in redis.lrange(subjects.PLAN_HISTORY_KEY, 0, -1)]


def live(redis: Redis, role: str) -> dict[str, dict[str, Any]]:
    ids = sorted(m.decode() for m in redis.smembers(subjects.role_set(role)))
    values = [redis.get(subjects.instance_key(i)) for i in ids]
    return {i: json.loads(v) for i, v in zip(ids, values, strict=True) if v is not None}


def wait_for(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def test_draining_a_decode_instance_loses_none_of_its_requests(tmp_path: Path) -> None:
    stack = start_stack(tmp_path, prefill=1, decode=2)
    try:
        redis = Redis.from_url(stack.env["DS_REDIS_URL"])
        target = Target(stack.url, MODEL, timeout_s=300)
        thread, result = in_background(target, requests(6, 24, 48, 0.1))
        # once both decode instances are streaming, drain one of them
        wait_for(lambda: all(i["running"] > 0 for i in live(redis, "decode").values()), 120,
                 "both decode instances to run requests")

        async def drain() -> None:
            nc = await connect(stack.env["DS_NATS_URL"], "test")
            await publish(nc, subjects.drain("decode-0"), Drain(reason="test"))
            await nc.flush()
            await nc.close()

        asyncio.run(drain())
        wait_for(lambda: live(redis, "decode").get("decode-0", {}).get("draining", True), 10,
                 "decode-0 to leave dispatch")
        # requests sent during the drain go to the other instance and complete too
        late = asyncio.run(run_requests(target, requests(3, 24, 8, 0.2), 1.0))
        thread.join(timeout=300)
        records = result[0].records + late.records
        assert [r.error for r in records] == [None] * 9
        assert [r.tokens for r in records] == [48] * 6 + [8] * 3
        # decode-0 exits on its own once it holds nothing, and leaves the registry
        assert stack.child("decode-0").wait(timeout=60) == DRAINED
        assert set(live(redis, "decode")) == {"decode-1"}
        log = (stack.run_dir / "decode-0.log").read_text()
        assert "draining" in log and "drained in" in log
    finally:
        stack.stop()


def planner_env(devices: int, modes: str, window: int, tpot_s: float,
                **more: str) -> dict[str, str]:
    """A planner on `devices` deploying `modes`, a profiler flagging shifts over a
    `window` of requests within seconds; plans follow the workload only (a busy host's
    slower steps would replan), priced by the generic shipped profile on every host."""
    return {"DS_PLANNER_PROFILE": str(shipped_cpu_profile(1)),
            "DS_PLANNER_DEVICES": str(devices), "DS_PLANNER_MODES": modes,
            "DS_PROFILER_WINDOW": str(window), "DS_PROFILER_COOLDOWN_S": "5",
            "DS_PROFILER_CHECK_EVERY": "2", "DS_PLANNER_TTFT_S": "5",
            "DS_PLANNER_TPOT_S": str(tpot_s), "DS_PROFILER_RECALIBRATE_RATIO": "100", **more}


def write_trace(path: Path) -> None:
    """Mooncake JSONL: 30 short-prompt, longer-output requests every 0.5 s, then 36 with
    long prompts and 2-token outputs every 1 s."""
    rows = [(500 * i, 16, 24) for i in range(30)]
    rows += [(15_000 + 1000 * i, 384, 2) for i in range(36)]
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": p,
                                        "output_length": o, "hash_ids": []}) + "\n"
                            for t, p, o in rows))


def assert_history_replays(history: list[dict[str, Any]], env: dict[str, str]) -> None:
    """The live planner's decisions, made again from their recorded inputs by the pure
    `decide`, are the same records (but the search's duration)."""
    with mock.patch.dict(os.environ, env):
        config = PlannerSettings().config()
    for entry in history:
        replayed = decide(ReplanRequest(reasons=entry["reasons"],
                                        workload=WorkloadSummary(**entry["inputs"])),
                          None, config, entry["made_at"], Calibration(**entry["calibration"]),
                          entry["current_mode"],
                          {kind: Shape(**shape) for kind, shape in entry["current_shapes"].items()})
        assert replayed is not None
        recorded = {k: v for k, v in entry.items() if k != "search_s"}
        assert json.loads(json.dumps(replayed.record)) == recorded


def test_longer_prompts_move_capacity_to_prefill_without_losing_requests(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the plans follow the workload only: on a loaded host the short prompts' prefill steps
    # ran 2.5x the profile and decode 1.1x, and a calibrated planner gave prefill two
    # instances from the start (how the calibration moves plans: tests/planner)
    env = planner_env(devices=3, modes="disaggregated", window=20, tpot_s=0.25,
                      DS_PROFILER_ALPHA="0.01", DS_PLANNER_CALIBRATE="false")
    stack = start_stack(tmp_path, prefill=1, decode=2, planner=True, extra_env=env)
    try:
        redis = Redis.from_url(stack.env["DS_REDIS_URL"])
        trace = tmp_path / "shift.jsonl"
        write_trace(trace)
        out = tmp_path / "replay.json"
        # every request completes: replay exits 0 only when none failed
        assert main(["replay", str(trace), "--url", stack.url, "--out", str(out)]) == 0
        records = json.loads(out.read_text())
        assert len(records) == 66 and all(r["error"] is None for r in records)
        history = plan_history(redis)
        first, *later = reversed(history)
        assert first["reasons"] == ["first full window"]
        assert (first["prefill"], first["decode"]) == (1, 2)  # short prompts: decode-heavy
        shift = next(p for p in later if any("prompt lengths" in r for r in p["reasons"]))
        assert (shift["prefill"], shift["decode"]) == (2, 1)
        # the new prefill instance serves, a decode instance drained away
        wait_for(lambda: len(live(redis, "prefill")) == 2 and len(live(redis, "decode")) == 1,
                 120, "the deployment to match the plan")
        plan = json.loads(redis.get(subjects.PLAN_KEY) or "{}")
        assert len(plan["applied"]["started"]) == 1 and len(plan["applied"]["drained"]) == 1
        # the last requests' events reach the profiler just after their streams end
        def seen() -> int:
            return int(json.loads(redis.get(subjects.PROFILER_KEY) or "{}")["requests_seen"])
        wait_for(lambda: seen() >= 66, 30, "the profiler to see every request")
        assert seen() == 66
        assert_history_replays(history, stack.env)
        # the profiler still measured the workers' step times (1.0: too few steps yet)
        calibration = Calibration.model_validate_json(redis.get(subjects.CALIBRATION_KEY) or "")
        assert calibration.prefill_steps >= 10 and calibration.decode_steps >= 10
        # within 10x of the generic profile either way: the hosts differ (on a Zen 5 EPYC
        # its decode steps ran 0.30-0.32x the profile's, and once 0.297x)
        assert 0.1 < calibration.prefill < 10 and 0.1 < calibration.decode < 10
        # fitted on the steps (alone on the host or all of them), the workers' machine known
        assert calibration.prefill_basis != "profile" and calibration.decode_basis != "profile"
        assert {info["machine"] for info in live(redis, "decode").values()} == {machine_id()}
        capsys.readouterr()
        assert main(["plan", "--live", "--redis-url", stack.env["DS_REDIS_URL"]]) == 0
        shown = capsys.readouterr().out
        assert "2 prefill + 1 decode of 3 devices" in shown
        assert "prompt lengths changed" in shown and "1P+2D" in shown
        assert "step times on the workers" in shown and "modes weighed" in shown
    finally:
        stack.stop()


def test_the_planner_switches_a_disaggregated_stack_to_colocated_workers(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A stack started disaggregated (1P+1D) whose planner may deploy colocated modes only
    (which of plain and chunked colocated wins is the simulator's call, tested on its own in
    tests/planner): on the first full window of chat-like requests the planner switches
    modes. Two colocated workers start, then the prefill and decode instances drain and
    exit; the gateway (auto mode) follows, and no request is lost on the way. The planner,
    killed then, takes none of them down: the launcher started them."""
    env = planner_env(devices=2, modes="colocated,chunked", window=16, tpot_s=0.2)
    stack = start_stack(tmp_path, prefill=1, decode=1, planner=True, extra_env=env)
    try:
        redis = Redis.from_url(stack.env["DS_REDIS_URL"])
        target = Target(stack.url, MODEL, timeout_s=300)

        def switched() -> bool:
            return len(live(redis, "colocated")) == 2 and not live(redis, "prefill") \
                and not live(redis, "decode")

        # the last 6 requests only the colocated workers serve
        served_across(target, requests(40, 16, 24, 0.4), switched,
                      "two colocated workers to replace the prefill/decode pair",
                      requests(6, 16, 24, 0.2), tokens=24)
        assert stack.child("prefill-0").wait(timeout=60) == DRAINED  # not killed
        assert stack.child("decode-0").wait(timeout=60) == DRAINED
        history = plan_history(redis)
        first = history[-1]
        assert first["reasons"] == ["first full window"] and first["colocated"] == 2
        assert first["current_mode"] == "disaggregated" and first["mode"] in ("colocated",
                                                                              "chunked")
        # the workers prefill as the plan's mode does
        workers = live(redis, "colocated").values()
        assert [w["chunked"] for w in workers] == [history[0]["mode"] == "chunked"] * 2
        assert_history_replays(history, stack.env)
        capsys.readouterr()
        assert main(["plan", "--live", "--redis-url", stack.env["DS_REDIS_URL"]]) == 0
        shown = capsys.readouterr().out
        assert "colocated of 2 devices" in shown

        # the planner is killed: the workers it deployed are the launcher's, and serve on
        serving = set(live(redis, "colocated"))
        deployed = {c.name: c.proc for c in stack.children
                    if c.name.startswith(("colocated-", "chunked-"))}
        stack.child("planner").kill()
        late = asyncio.run(run_requests(target, requests(6, 16, 24, 0.2), 1.0)).records
        assert [r.error for r in late] == [None] * 6 and {r.tokens for r in late} == {24}
        # it comes back, plans again for the last workload, finds them live, starts none
        children = {c.name for c in stack.children}

        def replanned() -> bool:
            applied = "applied_at" in json.loads(redis.get(subjects.PLAN_KEY) or "{}")
            return applied and any(h["reasons"] == ["the planner restarted"]
                                   for h in plan_history(redis))

        wait_for(replanned, 180, "the restarted planner to plan again and apply it")
        assert set(live(redis, "colocated")) == serving  # the same instances, none new
        assert len(deployed) == 2 and {c.name for c in stack.children} == children
        assert all(proc.poll() is None for proc in deployed.values())
        assert {c.name: c.proc for c in stack.children if c.name in deployed} == deployed
        assert stack.restarts()["planner"] == 1
    finally:
        stack.stop()


def test_the_planner_gives_prefill_the_tensor_parallel_shape_that_serves_more(
        tmp_path: Path) -> None:
    """A profile where three devices run a step in a quarter of one's time: on four devices
    the first window of 384-token prompts plans one prefill instance of tp 3 and one decode
    instance. The deployer starts the tp 3 prefill worker (three rank processes), drains the
    one-rank prefill worker once it serves, keeps the decode worker, and no request is lost;
    the new worker serves what comes after."""
    shipped = load_profile(shipped_cpu_profile(1))
    profile = tmp_path / "two-tps.json"
    save_profile(dataclasses.replace(shipped, by_tp={1: shipped.by_tp[1],
                                                     3: shipped.by_tp[1].slowed(0.25, 0.25)}),
                 profile)
    env = planner_env(devices=4, modes="disaggregated", window=8, tpot_s=0.25,
                      DS_PLANNER_CALIBRATE="false", DS_PLANNER_PROFILE=str(profile))
    stack = start_stack(tmp_path, prefill=1, decode=1, planner=True, extra_env=env)
    try:
        redis = Redis.from_url(stack.env["DS_REDIS_URL"])
        target = Target(stack.url, MODEL, timeout_s=300)

        def reshaped() -> bool:
            prefill = list(live(redis, "prefill").values())
            return [w["tp"] for w in prefill] == [3] and len(live(redis, "decode")) == 1

        served_across(target, requests(16, 384, 4, 0.5), reshaped,
                      "a tp 3 prefill worker to replace the one-rank one",
                      requests(4, 384, 4, 0.2), tokens=4)
        assert stack.child("prefill-0").wait(timeout=60) == DRAINED  # not killed
        assert "decode-0" in live(redis, "decode")
        history = plan_history(redis)
        first = history[-1]
        assert first["reasons"] == ["first full window"]
        assert (first["prefill"], first["prefill_shape"], first["decode"],
                first["decode_shape"]) == (1, {"tp": 3, "pp": 1}, 1, {"tp": 1, "pp": 1})
        assert first["fixed"] == {}
        plan = json.loads(redis.get(subjects.PLAN_KEY) or "{}")  # in force, and applied
        assert plan["prefill_shape"] == {"tp": 3, "pp": 1} and "applied_at" in plan
        assert_history_replays(history, stack.env)
    finally:
        stack.stop()
