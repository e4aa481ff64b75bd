"""`distserve plan --live`: what the planner and the profiler of a running stack think."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import nats
import nats.errors
from redis.exceptions import RedisError
from rich.console import Console
from rich.table import Table

from distserve.commands.common import without_password
from services.launcher import read_run_env
from services.planner.budget import Shape
from services.planner.calibration import Calibration
from services.planner.modes import SWITCH_MARGIN, Candidate
from shared import subjects
from shared.bus import publish
from shared.messages import ReplanRequest
from shared.state import redis_client

REACH_TIMEOUT_S = 5.0  # for the stack's NATS or Redis to answer


def stack_env(run_dir: Path) -> dict[str, str]:
    """The DS_* settings of the newest run under `run_dir` (distserve up writes them)."""
    runs = sorted(run_dir.glob("*/env"))
    return read_run_env(runs[-1].parent) if runs else {}


async def _read(redis_url: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None,
                                        list[dict[str, Any]]]:
    redis = redis_client(redis_url, timeout_s=REACH_TIMEOUT_S)
    try:
        plan, view = await redis.mget([subjects.PLAN_KEY, subjects.PROFILER_KEY])
        history = await redis.lrange(subjects.PLAN_HISTORY_KEY, 0, 9)
    finally:
        await redis.aclose()
    return (json.loads(plan) if plan else None, json.loads(view) if view else None,
            [json.loads(h) for h in history])


async def _replan(nats_url: str) -> None:
    """Publish a replan request; an error (nats' own) where the server cannot be reached
    within a few seconds."""
    async def quiet(_: Exception) -> None:  # a failed connection is raised, not logged
        pass

    async with asyncio.timeout(2 * REACH_TIMEOUT_S):
        nc = await nats.connect(  # one attempt (0 would be: for ever)
            nats_url, name="distserve-cli", allow_reconnect=False, max_reconnect_attempts=1,
            connect_timeout=REACH_TIMEOUT_S, error_cb=quiet)
    await publish(nc, subjects.REPLAN, ReplanRequest(reasons=["requested from the CLI"]))
    await nc.drain()


def stale(given: str | None, run_dir: Path) -> str:
    """Where a URL was not `given` but read from the newest run's settings: that its stack
    may be gone."""
    runs = sorted(run_dir.glob("*/env"))
    if given or not runs:
        return ""
    return f" (the URL is the newest run's, {runs[-1].parent}: is its stack still running?)"


def _ago(stamp: float) -> str:
    return f"{time.time() - stamp:.0f}s ago"


def show_live(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    env = stack_env(args.run_dir)
    redis_url = args.redis_url or env.get("DS_REDIS_URL")
    if not redis_url:
        parser.error(f"no running stack found under {args.run_dir}; give --redis-url")
    console = Console(soft_wrap=True)
    if args.replan:
        nats_url = args.nats_url or env.get("DS_NATS_URL")
        if not nats_url:
            parser.error("--replan needs the stack's NATS: give --nats-url")
        try:
            asyncio.run(_replan(nats_url))
        except (OSError, TimeoutError, ValueError, nats.errors.Error) as e:
            parser.error(f"cannot reach NATS at {without_password(nats_url)}: "
                         f"{str(e) or type(e).__name__}{stale(args.nats_url, args.run_dir)}")
        console.print(f"sent a replan request on {subjects.REPLAN} (the planner of a stack "
                      "started with --planner auto plans again)")
    try:
        plan, view, history = asyncio.run(_read(redis_url))
    except (OSError, RedisError, ValueError) as e:
        parser.error(f"cannot reach Redis at {without_password(redis_url)}: "
                     f"{e}{stale(args.redis_url, args.run_dir)}")
    if plan is None:
        console.print("no plan yet: the planner plans once the profiler has seen a full "
                      "window of requests (is the stack running with --planner auto?)")
    else:
        applied = plan.get("applied") or {}
        console.print(f"[bold]plan[/bold] ({_ago(plan['made_at'])}): {layout(plan)} of "
                      f"{plan['budget']} devices; predicted goodput {plan['goodput_rps']:.2f} "
                      f"req/s, attainment {plan['attainment']:.0%} at the rate")
        console.print(f"  why: {'; '.join(plan['reasons'])}")
        console.print("  modes weighed (goodput on the budget): " + ", ".join(
            f"{c['mode']} {c['goodput_rps']:.2f} req/s" for c in plan.get("candidates", []))
            + (f"; best: {plan['best_mode']}" if plan.get("best_mode") else ""))
        current, best = plan.get("current_mode"), plan.get("best_mode")
        if current and current != plan["mode"]:
            console.print(f"  the plan moves the workers from {current} to {plan['mode']}")
        elif best and best != plan["mode"]:
            margin = plan.get("switch_margin", SWITCH_MARGIN)
            why = (f"not {margin}x better: not worth restarting the workers for"
                   if best in plan.get("deployable", []) else "not one the planner deploys")
            console.print(f"  {plan['mode']} rather than {best}: {why}")
        w = plan["workload"]
        console.print(f"  for: {w['rate_rps']:.2f} req/s (CV {w['arrival_cv']:.2f}), prompts "
                      f"{w['prompt_mean']:.0f} and outputs {w['output_mean']:.0f} tokens on "
                      f"average over {w['requests']} requests")
        console.print(f"  applied: started {applied.get('started', [])}, drained "
                      f"{applied.get('drained', [])}" if applied else "  applying ...")
    if view is not None:
        table = Table(title=f"profiler ({view['requests_seen']} requests seen, window "
                            f"{view['window']})")
        for column in ("window", "requests", "req/s", "CV", "prompt p50", "prompt p90",
                       "output p50", "output p90"):
            table.add_column(column, justify="right")
        for name in ("reference", "recent"):
            s = view.get(name)
            if s:
                table.add_row(name, str(s["requests"]), f"{s['rate_rps']:.2f}",
                              f"{s['arrival_cv']:.2f}", f"{s['prompt_p50']:.0f}",
                              f"{s['prompt_p90']:.0f}", f"{s['output_p50']:.0f}",
                              f"{s['output_p90']:.0f}")
        console.print(table)
        if view.get("calibration"):
            c = Calibration.model_validate(view["calibration"])
            console.print(f"  step times on the workers: prefill {c.describe('prefill')}, "
                          f"decode {c.describe('decode')} (over {c.prefill_steps} and "
                          f"{c.decode_steps} steps)")
        for shift in view.get("shifts", [])[-3:]:
            console.print(f"  shift {_ago(shift['at'])}: {'; '.join(shift['reasons'])}")
    if len(history) > 1:
        console.print("earlier plans: " + ", ".join(
            f"{layout(h, short=True)} ({_ago(h['made_at'])})" for h in history[1:]))
    return 0


def layout(plan: dict[str, Any], short: bool = False) -> str:
    """A recorded plan's workers: '1 prefill tp2 + 2 decode' ('1P tp2+2D'), '2 chunked
    colocated' (modes.Candidate.layout; records from before plans had shapes: one device
    each)."""
    def shape(role: str) -> Shape:
        return Shape(**plan.get(f"{role}_shape", {}))

    candidate = Candidate(plan.get("mode", "disaggregated"), plan.get("prefill", 0),
                          plan.get("decode", 0), plan.get("colocated", 0), 0.0, 0.0,
                          prefill_shape=shape("prefill"), decode_shape=shape("decode"),
                          colocated_shape=shape("colocated"))
    if short and candidate.mode == "disaggregated":
        return (f"{candidate.prefill}{candidate.prefill_shape.label('P')}+"
                f"{candidate.decode}{candidate.decode_shape.label('D')}")
    return candidate.layout
