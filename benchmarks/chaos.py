"""Chaos: faults under load. A 2 prefill + 2 decode stack serves a fixed open-loop load while
faults are injected one after another; per fault: what happened to the requests it hit, how
long the stack took to serve normally again, and what it moved; at the end, that no request
was lost and no KV block leaked. Then the prefill memory that KV retention costs.

    .venv/bin/python benchmarks/chaos.py [--rate 0.7] [--gap 60] [--quick]   # ~15 minutes

Load: Poisson arrivals at `--rate` for the whole run (`--baseline` seconds before the first
fault, then `--gap` seconds per fault), streaming completions over httpx; prompts are the
HumanEval prompts of 100-300 tokens (the first `--prompts` of them), each with its own fixed
output length of 32-64 tokens, greedy with ignore_eos: the same prompt always asks for the
same tokens, so a moved request's text can be checked against an unmoved one's.

Faults (`--faults`, in that order, `--gap` seconds apart):
  decode-kill     SIGKILL decode-0's current process (the supervisor restarts it as -rN)
  prefill-kill    SIGKILL prefill-0's current process
  valkey-freeze   SIGSTOP valkey for `--freeze` seconds, then SIGCONT
  valkey-restart  take valkey down through the stack's supervisor (which would restart it
                  within a second: told not to, it kills it at once), `--down` seconds
                  later start it again (same argv: port, password, config)
  nats-restart    the same for nats-server
  prefill-freeze  SIGSTOP prefill-1 for `--prefill-freeze` seconds, then SIGCONT
  decode-wedge    wedge decode-0's engine thread in its next step, for good, the GIL released
                  (as a kernel that never returns): its event loop and heartbeats go on. The
                  stack then runs with DS_STEP_TIMEOUT_S `--step-timeout` (default 20) and
                  tests/services/wedge on its workers' PYTHONPATH (a sitecustomize that wedges
                  the worker a file names; nothing otherwise)

Each request is counted exactly once, under the fault that hit it first: the fault in
whose window it arrived if it arrived before the stack had recovered from it, else the first
fault injected while it was in flight; a request no fault hit is counted under the window it
arrived in (before the first fault: the baseline). Outcomes: completed (a finish_reason and
exactly its max_tokens tokens; a completion with another count is "wrong length"), failed (an
HTTP error, a connection error or an SSE error event) or lost (no end within `--deadline`
seconds of being sent: long enough that a lost request is a bug, never a slow one).

Recovery, two figures from the injection: "all live", until /health (sampled about every
0.5 s) shows every instance live (2 prefill + 2 decode) for the rest of the fault's window;
"recovered", until the stack serves normally again: the first moment s from which, to the
end of the window, every instance is live and every request that arrives (and ends before
the next fault) completes within `--slow` x the baseline's p99 of seconds per output token
(end-to-end latency / max_tokens). A rolling completion rate would say the same with much
more noise at about one request a second; a burst of arrivals delays "recovered" as a fault
does. "Affected": in flight at the injection or arriving before s (all of the fault's
requests when it did not recover within its window). Extra latency: the affected and the
moved requests' p50/p99 end-to-end latency beside the baseline's p50. Moved requests and
the causes of their moves come from the "moved" events of their gateway traces; moves by
cause/path are /metrics deltas from the fault's injection to the next one's (the last
fault's: until every request has ended), so a late move shows in a later window there.

Leaks: after the load, until the gateway has nothing in flight and every live instance's KV
pool is free again (`--settle` seconds at most); the blocks still held then are leaked.

Retention: during the baseline (no fault) the prefill instances' held blocks (total - free)
are sampled (after the first 5 s); then a second stack with DS_KV_RETENTION_S=0 serves the same load
for `--retention-phase` seconds, sampled the same way. Mean and peak blocks and bytes of both.

Results: chaos.json in the chaos run's stack's folder under `--run-dir` (beside its logs and
traces); `--report` prints the tables again from it. Exits 1 if a request was lost, completed
with the wrong length, or a block leaked.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

from distserve.bench import scrape
from distserve.bench.runner import read_spans
from distserve.bench.workload import Tokenizer, humaneval_prompts
from services.launcher import Stack, StackConfig
from services.process import WorkerSettings
from services.supervisor import Restart, free_port, incarnation, wait_for_port
from shared.engine.kv_cache import block_bytes
from shared.engine.meta import read_meta
from shared.engine.model_runner import kv_dtype, resolve_device, resolve_dtype
from shared.metrics import percentiles
from shared.workloads import unit_rate_gaps

EXPECTED = {"prefill": 2, "decode": 2}
SAMPLE_S = 0.5
Clock = Callable[[], float]


# -- the load ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Job:
    index: int
    arrival_s: float
    model: str
    prompt_index: int
    prompt: str
    max_tokens: int


def workload(model: str, prompts: list[str], rate: float, duration_s: float,
             seed: int) -> list[Job]:
    """Poisson arrivals at `rate` for `duration_s`; prompt k always asks for 32-64 tokens."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(unit_rate_gaps(int(2 * rate * duration_s) + 50, rng) / rate)
    picks = rng.integers(0, len(prompts), len(arrivals))
    return [Job(i, float(at), model, int(k), prompts[k], 32 + (7 * int(k)) % 33)
            for i, (at, k) in enumerate(zip(arrivals, picks, strict=True)) if at < duration_s]


def load_prompts(count: int) -> list[str]:
    tok = Tokenizer()
    fitting = [p for p, _ in humaneval_prompts() if 100 <= len(tok.encode(p)) <= 300]
    return fitting[:count]


@dataclass
class Record:
    index: int
    prompt_index: int
    max_tokens: int
    sent_s: float = float("nan")
    end_s: float = float("nan")  # answered, failed, or given up on (lost)
    outcome: str = "lost"  # completed, failed, lost
    error: str | None = None
    tokens: int = 0  # completion_tokens of the final usage
    text: str = ""
    response_id: str = ""

    @property
    def latency_s(self) -> float:
        return self.end_s - self.sent_s

    @property
    def wrong_length(self) -> bool:
        return self.outcome == "completed" and self.tokens != self.max_tokens


async def stream(client: httpx.AsyncClient, url: str, job: Job, record: Record) -> None:
    """Stream one completion into `record` (outcome completed or failed)."""
    body = {"model": job.model, "prompt": job.prompt, "max_tokens": job.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    finish = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            record.outcome, record.error = "failed", f"HTTP {r.status_code}: " + \
                (await r.aread()).decode(errors="replace")[:200]
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                record.outcome, record.error = "failed", event["error"]["message"]
                return
            record.response_id = event["id"]
            record.tokens = (event.get("usage") or {}).get("completion_tokens", record.tokens)
            for choice in event["choices"]:
                record.text += choice["text"]
                finish = choice.get("finish_reason") or finish
    record.outcome = "completed" if finish else "failed"
    record.error = None if finish else "the stream ended without a finish_reason"


async def send(client: httpx.AsyncClient, url: str, job: Job, clock: Clock,
               deadline_s: float) -> Record:
    record = Record(job.index, job.prompt_index, job.max_tokens)
    await asyncio.sleep(max(0.0, job.arrival_s - clock()))
    record.sent_s = clock()
    try:
        async with asyncio.timeout(deadline_s):
            await stream(client, url, job, record)
    except TimeoutError:
        record.outcome, record.error = "lost", f"no end within {deadline_s:g} s"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        record.outcome, record.error = "failed", f"{type(e).__name__}: {e}"
    record.end_s = clock()
    return record


# -- the stack's state ------------------------------------------------------------------------

@dataclass
class Sample:
    t: float
    live: dict[str, int] | None  # instances per role on /health, not stuck; None: no answer
    held: dict[str, float]  # instance -> KV blocks in use (total - free)
    roles: dict[str, str]  # instance -> role
    inflight: float | None = None


async def sample(client: httpx.AsyncClient, url: str, clock: Clock) -> Sample:
    t = clock()
    try:
        body = (await client.get(f"{url}/health", timeout=5)).json()
        health = dict(body["instances"])  # live, less those whose engine is stuck
        for stuck in body.get("stuck_ids", []):
            role = stuck.split("-")[0]
            health[role] = health.get(role, 0) - 1
        text = (await client.get(f"{url}/metrics", timeout=5)).text
    except httpx.HTTPError:
        return Sample(t, None, {}, {})
    total = {labels["instance"]: v for labels, v in scrape.samples(text, "ds_kv_total_blocks")}
    free = {labels["instance"]: v for labels, v in scrape.samples(text, "ds_kv_free_blocks")}
    roles = {labels["instance"]: labels["role"]
             for labels, _ in scrape.samples(text, "ds_kv_total_blocks")}
    inflight = [v for _, v in scrape.samples(text, "ds_gateway_inflight")]
    return Sample(t, health, {i: n - free.get(i, n) for i, n in total.items()}, roles,
                  inflight[0] if inflight else None)


def whole(s: Sample) -> bool:
    return s.live is not None and all(s.live.get(r, 0) >= n for r, n in EXPECTED.items())


async def sample_until(client: httpx.AsyncClient, url: str, clock: Clock,
                       samples: list[Sample], stop: asyncio.Event) -> None:
    while not stop.is_set():
        samples.append(await sample(client, url, clock))
        await asyncio.sleep(SAMPLE_S)


async def moves(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    text = (await client.get(f"{url}/metrics", timeout=10)).text
    return {f"{labels['cause']}/{labels['path']}": n
            for labels, n in scrape.samples(text, "ds_request_moves_total")}


# -- faults -----------------------------------------------------------------------------------

async def kill(stack: Stack, name: str) -> None:
    stack.child(name).send_signal(signal.SIGKILL)


async def freeze(stack: Stack, name: str, seconds: float) -> None:
    proc = stack.child(name)
    proc.send_signal(signal.SIGSTOP)
    try:
        await asyncio.sleep(seconds)
    finally:
        proc.send_signal(signal.SIGCONT)


async def restart_server(stack: Stack, name: str, down_s: float) -> None:
    """Take a server down for `down_s` (the supervisor, which would bring it back within a
    second, told to leave it: a kill at once), then start it again with the same argv and
    environment (its port, password and config)."""
    (child,) = [c for c in stack.children if c.name == name]
    await asyncio.to_thread(stack.supervisor.stop, [name], 0.0)
    await asyncio.sleep(down_s)
    proc = stack.supervisor.spawn(name, child.argv, child.env, restart=Restart.ALWAYS)
    flag = "-p" if "-p" in child.argv else "--port"
    await asyncio.to_thread(wait_for_port, int(child.argv[child.argv.index(flag) + 1]), proc,
                            name)


async def wedge(stack: Stack, name: str) -> None:
    """Wedge child `name`'s current incarnation (the next one is another instance)."""
    instance = incarnation(name, stack.restarts()[name])
    Path(stack.env["DS_TEST_WEDGE_FILE"]).write_text(instance)


WEDGE_HOOK = Path(__file__).resolve().parents[1] / "tests" / "services" / "wedge"


def fault_env(args: argparse.Namespace) -> dict[str, str]:
    """What the chaos stack's children need for the faults asked: the wedge hook, and the
    step timeout that ends a wedged worker."""
    if "decode-wedge" not in args.faults:
        return {}
    args.run_dir.mkdir(parents=True, exist_ok=True)
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"PYTHONPATH": os.pathsep.join([str(WEDGE_HOOK), *inherited]),
            "DS_STEP_TIMEOUT_S": f"{args.step_timeout:g}",
            "DS_TEST_WEDGE_FILE": str(args.run_dir.resolve() / f"wedge-{time.time_ns()}")}


Inject = Callable[[Stack, argparse.Namespace], Awaitable[None]]
FAULTS: dict[str, Inject] = {
    "decode-kill": lambda s, a: kill(s, "decode-0"),
    "prefill-kill": lambda s, a: kill(s, "prefill-0"),
    "valkey-freeze": lambda s, a: freeze(s, "valkey", a.freeze),
    "valkey-restart": lambda s, a: restart_server(s, "valkey", a.down),
    "nats-restart": lambda s, a: restart_server(s, "nats", a.down),
    "prefill-freeze": lambda s, a: freeze(s, "prefill-1", a.prefill_freeze),
    "decode-wedge": lambda s, a: wedge(s, "decode-0"),
}


@dataclass
class Injected:
    name: str
    at_s: float
    done_s: float  # the injection's action over (SIGCONT sent, server listening again)
    moves_before: dict[str, float]
    moves_after: dict[str, float] = field(default_factory=dict)


# -- a run ------------------------------------------------------------------------------------

@dataclass
class Run:
    records: list[Record]
    injected: list[Injected]
    samples: list[Sample]
    end_s: float  # the last arrival's window closed
    settle_s: float = float("nan")  # after the load, until nothing was held (or the limit)
    settled: Sample | None = None  # the stack then

    @property
    def leaked(self) -> float:
        return sum(self.settled.held.values()) if self.settled else float("nan")

    def settle_line(self, name: str) -> str:
        s = self.settled
        outcomes = dict(collections.Counter(r.outcome for r in self.records))
        return (f"{name}: {len(self.records)} requests {outcomes}; settled {self.settle_s:.1f} s "
                f"after the load: in flight {s and s.inflight}, instances {s and s.live}, "
                f"KV blocks held {s and s.held}")


async def serve_load(stack: Stack, jobs: list[Job], schedule: list[tuple[float, str]],
                     end_s: float, args: argparse.Namespace) -> Run:
    """Send `jobs` on time, inject `schedule`'s faults at their times; until every request
    has ended or passed its deadline."""
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=httpx.Timeout(30, read=None), limits=limits) as c:
        start = time.monotonic()

        def clock() -> float:
            return time.monotonic() - start

        samples: list[Sample] = []
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_until(c, stack.url, clock, samples, stop))
        tasks = [asyncio.create_task(send(c, stack.url, j, clock, args.deadline)) for j in jobs]
        injected: list[Injected] = []
        for at, name in schedule:
            await asyncio.sleep(max(0.0, at - clock()))
            before = await moves(c, stack.url)
            if injected:
                injected[-1].moves_after = before
            print(f"{clock():6.1f}s  {name}", flush=True)
            began = clock()
            await FAULTS[name](stack, args)
            injected.append(Injected(name, began, clock(), before))
        records = list(await asyncio.gather(*tasks))
        if injected:  # the last fault's moves include those after the load, until every end
            injected[-1].moves_after = await moves(c, stack.url)
        stop.set()
        await sampler
    return Run(records, injected, samples, end_s)


async def warm_up(url: str, jobs: list[Job]) -> None:
    """Send `jobs` at once, uncounted: the first steps of a fresh engine are slow."""
    async with httpx.AsyncClient(timeout=300) as c:
        done = await asyncio.gather(*(send(c, url, dataclasses.replace(j, arrival_s=0),
                                           lambda: 0.0, 300) for j in jobs))
    if any(r.outcome != "completed" for r in done):
        raise RuntimeError(f"a warm-up request failed: {[r.error for r in done]}")


def settle(url: str, timeout_s: float) -> tuple[float, Sample]:
    """Until nothing is in flight and every live instance's pool is free (at most
    `timeout_s`): the seconds waited and the last sample."""
    async def wait() -> tuple[float, Sample]:
        start = time.monotonic()
        async with httpx.AsyncClient() as c:
            while True:
                s = await sample(c, url, lambda: time.monotonic() - start)
                if (s.inflight == 0 and whole(s) and not sum(s.held.values())) or \
                        s.t > timeout_s:
                    return s.t, s
                await asyncio.sleep(SAMPLE_S)
    return asyncio.run(wait())


def start_stack(args: argparse.Namespace, extra_env: dict[str, str]) -> Stack:
    stack = Stack(StackConfig(port=free_port(), run_dir=args.run_dir, model=args.model,
                              extra_env=extra_env, prefill=EXPECTED["prefill"],
                              decode=EXPECTED["decode"]))
    stack.start()
    return stack


def run_stack(args: argparse.Namespace, jobs: list[Job], schedule: list[tuple[float, str]],
              end_s: float, extra_env: dict[str, str]) -> tuple[Run, Path]:
    """A fresh stack serving `jobs` with `schedule`'s faults; the run, settled, and the
    stack's run dir (its traces read after it stopped, when every span is written)."""
    stack = start_stack(args, extra_env)
    try:
        asyncio.run(warm_up(stack.url, jobs[:4]))
        run = asyncio.run(serve_load(stack, jobs, schedule, end_s, args))
        waited, last = settle(stack.url, args.settle)
    finally:
        stack.stop()
    return dataclasses.replace(run, settle_s=waited, settled=last), stack.run_dir


# -- what happened ----------------------------------------------------------------------------

@dataclass
class Period:
    """The requests counted under the baseline or under one fault, and what became of them."""

    name: str
    at_s: float | None  # the injection, on the load's clock
    action_s: float | None  # how long the injection's action took (a freeze, a restart)
    requests: int  # counted here
    affected: int | None  # in flight at the injection or arriving before the recovery
    completed: int
    failed: int
    lost: int
    wrong_length: int
    p50_s: float  # end-to-end latency of the affected requests completed (baseline: all)
    p99_s: float
    moved: int  # requests counted here that the gateway moved (their traces)
    moved_causes: dict[str, int]  # their moves by cause (traces)
    moved_text_differs: int  # ... whose text is not the unmoved requests' for that prompt
    moved_p50_s: float
    moved_p99_s: float
    all_live_s: float | None  # until every instance was live again; None: not in the window
    recovery_s: float | None  # until it served normally again; None: not in the window
    moves: dict[str, float]  # cause/path -> moves over the window (/metrics)
    errors: list[str]  # the distinct errors of the failed and lost requests


def period_of(r: Record, injected: list[Injected], untils: list[float]) -> int:
    """0: the baseline; k: the k-th fault, the first that hit `r` (see the module's
    docstring). `untils`: when the stack had recovered from each fault."""
    arrived = sum(f.at_s <= r.sent_s for f in injected)  # the window it arrived in
    if arrived and r.sent_s < untils[arrived - 1]:
        return arrived
    hit = (k for k, f in enumerate(injected, 1) if r.sent_s < f.at_s < r.end_s)
    return next(hit, arrived)


def per_token_s(r: Record) -> float:
    return r.latency_s / r.max_tokens


def all_live(f: Injected, window_end: float, samples: list[Sample]) -> float | None:
    """Seconds from the injection until /health shows every instance live for the rest of
    the window; None: not within the window."""
    inside = [s for s in samples if f.at_s <= s.t < window_end]
    down = [s.t for s in inside if not whole(s)]
    if not down:
        return 0.0
    return down[-1] - f.at_s if inside[-1].t > down[-1] else None


def recovery(f: Injected, window_end: float, records: list[Record], samples: list[Sample],
             limit_s: float) -> float | None:
    """Seconds from the injection until the stack serves normally again (see the module's
    docstring); None: not within the window."""
    live = all_live(f, window_end, samples)
    ended = [r for r in records if f.at_s <= r.sent_s < window_end and r.end_s < window_end]

    def bad(r: Record) -> bool:
        return r.outcome != "completed" or per_token_s(r) > limit_s

    if live is None:
        return None
    since = max([f.at_s + live] + [r.sent_s for r in ended if bad(r)])
    if all(bad(r) for r in ended if r.sent_s > since):
        return None
    return since - f.at_s


Moves = dict[str, list[str]]  # response id -> the cause of each of its moves


def traced_moves(run_dir: Path) -> Moves:
    """The moved requests, from the "moved" events of their gateway spans."""
    out: Moves = {}
    for s in read_spans(run_dir):
        causes = [e["attributes"]["cause"] for e in s["events"] if e["name"] == "moved"]
        if s["name"] == "request" and causes:
            out["cmpl-" + s["attributes"]["request_id"]] = causes
    return out


def references(records: list[Record], moved: Moves) -> dict[int, str]:
    """Per prompt, the most common text of its completed requests that were never moved."""
    texts: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for r in records:
        if r.outcome == "completed" and r.response_id not in moved:
            texts[r.prompt_index][r.text] += 1
    return {k: c.most_common(1)[0][0] for k, c in texts.items()}


def summarize(name: str, counted: list[Record], affected: list[Record] | None,
              moved: Moves, refs: dict[int, str]) -> Period:
    latencies = [r.latency_s for r in (counted if affected is None else affected)
                 if r.outcome == "completed"]
    shifted = [r for r in counted if r.response_id in moved]
    shifted_done = [r for r in shifted if r.outcome == "completed"]
    lat = percentiles(latencies, (50, 99))
    moved_lat = percentiles([r.latency_s for r in shifted_done], (50, 99))
    return Period(
        name, None, None, len(counted), None if affected is None else len(affected),
        sum(r.outcome == "completed" for r in counted), sum(r.outcome == "failed" for r in counted),
        sum(r.outcome == "lost" for r in counted), sum(r.wrong_length for r in counted),
        lat["p50"], lat["p99"], len(shifted),
        dict(collections.Counter(c for r in shifted for c in moved[r.response_id])),
        sum(r.text != refs.get(r.prompt_index, r.text) for r in shifted_done),
        moved_lat["p50"], moved_lat["p99"], None, None, {},
        sorted({r.error for r in counted if r.error}))


def analyze(run: Run, moved: Moves, slow: float) -> list[Period]:
    """The baseline's period, then each fault's."""
    first = run.injected[0].at_s if run.injected else run.end_s
    limit = slow * percentiles([per_token_s(r) for r in run.records if r.end_s < first
                                and r.outcome == "completed"], (99,))["p99"]
    ends = [f.at_s for f in run.injected[1:]] + [run.end_s]
    backs = [recovery(f, end, run.records, run.samples, limit)
             for f, end in zip(run.injected, ends, strict=True)]
    untils = [end if back is None else f.at_s + back
              for f, end, back in zip(run.injected, ends, backs, strict=True)]
    counted: list[list[Record]] = [[] for _ in range(len(run.injected) + 1)]
    for r in run.records:
        counted[period_of(r, run.injected, untils)].append(r)
    refs = references(run.records, moved)
    baseline = summarize("baseline", counted[0], None, moved, refs)
    baseline.moves = run.injected[0].moves_before if run.injected else {}
    periods = [baseline]
    for k, (f, end, back, until) in enumerate(zip(run.injected, ends, backs, untils,
                                                  strict=True), 1):
        p = summarize(f.name, counted[k], [r for r in counted[k] if r.sent_s < until],
                      moved, refs)
        p.at_s, p.action_s, p.recovery_s = f.at_s, f.done_s - f.at_s, back
        p.all_live_s = all_live(f, end, run.samples)
        p.moves = {m: n - f.moves_before.get(m, 0) for m, n in f.moves_after.items()
                   if n > f.moves_before.get(m, 0)}
        periods.append(p)
    return periods


@dataclass
class Held:
    """KV blocks the prefill instances hold (total - free), sampled under load."""

    retention: str
    samples: int
    mean_blocks: float
    peak_blocks: float
    mean_mib: float
    peak_mib: float


def prefill_held(samples: list[Sample], since: float, until: float, bytes_per_block: int,
                 retention: str) -> Held:
    blocks = [sum(n for i, n in s.held.items() if s.roles[i] == "prefill")
              for s in samples if since <= s.t < until and s.live is not None]
    mean, peak = (float(np.mean(blocks)), float(max(blocks))) if blocks else (np.nan, np.nan)
    mib = bytes_per_block / 2**20
    return Held(retention, len(blocks), mean, peak, mean * mib, peak * mib)


def kv_block_bytes(model: str) -> int:
    """The bytes of one KV block of `model` in a worker with default settings."""
    settings = WorkerSettings(model=model)
    config, _ = read_meta(model)
    device = resolve_device(settings.device)
    return block_bytes(config, settings.block_size,
                       kv_dtype(device, resolve_dtype(settings.dtype, device)))


# -- the report -------------------------------------------------------------------------------

def s1(x: float | None) -> str:
    return "-" if x is None or x != x else f"{x:.1f}"


def within(x: float | None) -> str:
    return "not in window" if x is None else s1(x)


def row(p: Period, base_p50_s: float) -> list[str]:
    def extra(x: float) -> str:
        d = x - base_p50_s
        return "" if d != d else f" ({d:+.1f})"

    causes = ", ".join(f"{c} {n}" for c, n in sorted(p.moved_causes.items()))
    return [p.name, s1(p.at_s), s1(p.action_s), str(p.requests),
            "-" if p.affected is None else str(p.affected), str(p.completed), str(p.failed),
            str(p.lost), str(p.wrong_length),
            f"{s1(p.p50_s)}{extra(p.p50_s)} / {s1(p.p99_s)}{extra(p.p99_s)}",
            f"{p.moved} ({p.moved_text_differs})" + (f": {causes}" if causes else ""),
            f"{s1(p.moved_p50_s)} / {s1(p.moved_p99_s)}",
            "-" if p.at_s is None else within(p.all_live_s),
            "-" if p.at_s is None else within(p.recovery_s),
            ", ".join(f"{m} {n:g}" for m, n in sorted(p.moves.items())) or "-"]


def fault_table(periods: list[Period]) -> Table:
    base = periods[0].p50_s
    t = Table(title=f"Faults under load (2P+2D); baseline p50 {s1(base)} s")
    for column in ["period", "at s", "took s", "requests", "affected", "completed", "failed",
                   "lost", "wrong len", "affected p50 / p99 s (+ vs base p50)",
                   "moved (text ≠): causes", "moved p50 / p99 s", "all live s", "recovered s",
                   "moves cause/path"]:
        t.add_column(column, justify="left" if column.startswith(("period", "moves")) else
                     "right")
    for p in periods:
        t.add_row(*row(p, base if p.affected is not None else float("nan")))
    return t


def held_table(held: list[Held], bytes_per_block: int) -> Table:
    t = Table(title=f"Prefill KV held under the load ({bytes_per_block / 1024:g} KiB a block)")
    for column in ["DS_KV_RETENTION_S", "samples", "mean blocks", "peak blocks", "mean MiB",
                   "peak MiB"]:
        t.add_column(column, justify="right")
    for h in held:
        t.add_row(h.retention, str(h.samples), s1(h.mean_blocks), s1(h.peak_blocks),
                  s1(h.mean_mib), s1(h.peak_mib))
    return t


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


# -- the command ------------------------------------------------------------------------------

FULL: dict[str, Any] = {"faults": list(FAULTS), "baseline": 60.0, "gap": 60.0,
                        "retention_phase": 60.0}
QUICK: dict[str, Any] = {"faults": ["decode-kill", "valkey-restart"], "baseline": 20.0,
                         "gap": 30.0, "retention_phase": 20.0}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[2:]))
    add = parser.add_argument
    add("--rate", type=float, default=0.7,
        help="requests per second, Poisson (default 0.7: about 60%% of what the 2P+2D stack "
             "completed of this load on 2 cores, 1.2 req/s with 24 closed-loop clients)")
    add("--faults", nargs="+", choices=list(FAULTS), metavar="FAULT",
        help=f"in this order (default: all, {' '.join(FAULTS)}; --quick: "
             f"{' '.join(QUICK['faults'])})")
    add("--baseline", type=float, help="seconds of load before the first fault (default 60; "
                                       "--quick 20)")
    add("--gap", type=float, help="seconds from one fault to the next, and after the last "
                                  "(default 60; --quick 30)")
    add("--freeze", type=float, default=10, help="seconds valkey stays stopped (default 10)")
    add("--prefill-freeze", type=float, default=15,
        help="seconds prefill-1 stays stopped (default 15)")
    add("--down", type=float, default=2,
        help="seconds a killed server stays down before it is started again (default 2)")
    add("--step-timeout", type=float, default=20,
        help="DS_STEP_TIMEOUT_S of a stack that runs decode-wedge (default 20)")
    add("--deadline", type=float, default=300,
        help="seconds after which a request without an end counts as lost (default 300: "
             "well over the gateway's worst case of moves, waits and stall timeouts)")
    add("--slow", type=float, default=1.25,
        help="recovered means requests complete within this times the baseline's p99 of "
             "seconds per output token (default 1.25)")
    add("--settle", type=float, default=120,
        help="seconds to wait after the load for every KV pool to be free (default 120: "
             "more than the 30 s KV lease after which a prefill frees unpulled KV)")
    add("--retention-phase", type=float,
        help="seconds of the same load on a second stack with DS_KV_RETENTION_S=0 (default "
             "60; --quick 20; 0: skip)")
    add("--prompts", type=int, default=40,
        help="HumanEval prompts of 100-300 tokens used (default 40: each is sent several "
             "times, so moved requests' texts can be checked)")
    add("--model", default="smollm2-135m", help="the stack's model (default smollm2-135m)")
    add("--seed", type=int, default=0, help="of the arrivals and prompt picks (default 0)")
    add("--quick", action="store_true",
        help="a smoke run: two faults, shorter baseline, gaps and retention phase")
    add("--report", type=Path, metavar="CHAOS_JSON",
        help="start nothing: print the tables of an earlier run from its chaos.json (and the "
             "traces beside it), e.g. with another --slow")
    add("--run-dir", type=Path, default=Path("runs"),
        help="a new folder here per stack gets its logs and traces; chaos.json goes into the "
             "first")
    args = parser.parse_args()
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def retention_cost(args: argparse.Namespace, prompts: list[str], run: Run,
                   bytes_per_block: int) -> tuple[list[Held], Run | None]:
    """Prefill blocks held in the chaos run's baseline (default retention) and, unless
    skipped, in a run with retention 0; that run."""
    first = run.injected[0].at_s if run.injected else run.end_s
    default = f"default ({WorkerSettings().kv_retention_s:g})"
    held = [prefill_held(run.samples, 5, first, bytes_per_block, default)]
    if not args.retention_phase:
        return held, None
    jobs = workload(args.model, prompts, args.rate, args.retention_phase, args.seed + 1)
    quiet, _ = run_stack(args, jobs, [], args.retention_phase, {"DS_KV_RETENTION_S": "0"})
    held.append(prefill_held(quiet.samples, 5, args.retention_phase, bytes_per_block, "0"))
    return held, quiet


@dataclass
class Measured:
    run: Run  # the chaos run
    quiet: Run | None  # the retention-0 run
    held: list[Held]
    bytes_per_block: int
    run_dir: Path  # the chaos run's stack's


def measure(args: argparse.Namespace) -> Measured:
    prompts = load_prompts(args.prompts)
    duration = args.baseline + args.gap * len(args.faults)
    jobs = workload(args.model, prompts, args.rate, duration, args.seed)
    schedule = [(args.baseline + k * args.gap, name) for k, name in enumerate(args.faults)]
    print(f"{len(jobs)} requests at {args.rate:g} req/s over {duration:.0f} s; faults at "
          + ", ".join(f"{at:.0f} s {name}" for at, name in schedule), flush=True)
    run, run_dir = run_stack(args, jobs, schedule, duration, fault_env(args))
    bytes_per_block = kv_block_bytes(args.model)
    held, quiet = retention_cost(args, prompts, run, bytes_per_block)
    return Measured(run, quiet, held, bytes_per_block, run_dir)


def run_from(data: dict[str, Any]) -> Run:
    return Run([Record(**r) for r in data["records"]], [Injected(**f) for f in data["injected"]],
               [Sample(**s) for s in data["samples"]], data["end_s"], data["settle_s"],
               Sample(**data["settled"]) if data["settled"] else None)


def load(path: Path) -> Measured:
    """A run measured earlier, from its chaos.json (its traces beside it)."""
    data = json.loads(path.read_text())
    quiet = data["retention_run"]
    return Measured(run_from(data["run"]), quiet and run_from(quiet),
                    [Held(**h) for h in data["retention"]], data["kv_block_bytes"], path.parent)


def main() -> int:
    args = parse_args()
    m = load(args.report) if args.report else measure(args)
    periods = analyze(m.run, traced_moves(m.run_dir), args.slow)
    runs = [m.run] if m.quiet is None else [m.run, m.quiet]
    records = [r for each in runs for r in each.records]
    lost = sum(r.outcome == "lost" for r in records)
    wrong = sum(r.wrong_length for r in records)
    leaked = sum(each.leaked for each in runs)
    console = Console(width=240)
    console.print(fault_table(periods))
    for p in periods:
        for error in p.errors[:3]:
            console.print(f"  {p.name}: {error}")
    console.print(held_table(m.held, m.bytes_per_block))
    for name, each in zip(["chaos run", "retention-0 run"], runs, strict=False):
        console.print(each.settle_line(name))
    console.print(f"lost: {lost}; completed with the wrong length: {wrong}; "
                  f"KV blocks leaked: {leaked:g}")
    if not args.report:
        out = m.run_dir / "chaos.json"
        out.write_text(json.dumps({
            "args": vars(args), "host": cpu_model(), "kv_block_bytes": m.bytes_per_block,
            "periods": [asdict(p) for p in periods], "retention": [asdict(h) for h in m.held],
            "lost": lost, "wrong_length": wrong, "leaked_blocks": leaked,
            "run": asdict(m.run), "retention_run": m.quiet and asdict(m.quiet),
        }, indent=1, default=str))
        console.print(f"results: {out}")
    return 1 if lost or wrong or leaked else 0


if __name__ == "__main__":
    raise SystemExit(main())
