"""The gateway under overload: a 1P+1D stack offered 1x, 2x, 5x and 10x the rate it completes,
then the highest rate at which the gateway's own latency stays under 50 ms.

    .venv/bin/python benchmarks/overload.py [--duration 15] [--clients 128] [--levels 1 2 5 10]

Capacity: `--clients` closed-loop clients (each sends its next request when its last one is
answered) send short prompts with max_tokens 16 (ignore_eos: every request is 16 tokens);
capacity is the requests completed per second over `--duration` seconds, counted from the end
of the first round (as many completions as clients), when the pipeline is full. A decode step
costs little more for a larger batch, so the figure grows with the clients (on 2 cores: 1.6,
2.5 and 4.9 req/s with 16, 64 and 128); the default, 128, is the gateway's default in-flight
limit here (twice the decode batch of 64): the rate the stack completes when kept as full as
the gateway lets it be, without a 429. Above it, requests must queue or be refused.

Overload: open-loop Poisson arrivals at each multiple of the capacity for `--duration`
seconds (at most `--max-requests`), non-streaming, over loopback with aiohttp; what
is still unanswered `--drain` seconds after the last send is cancelled and counted as
unfinished. Per level: sent, accepted (not 429), completed (200 with a finish_reason), 429
(and how many lack Retry-After: must be 0), 5xx (must be 0), connection errors, p50/p99
end-to-end latency of the accepted requests; the same requests' p50/p99 as the gateway served
them (their "request" spans, below), and from each one's send to the start of its span (its
HTTP request sent, read, parsed, admitted, tokenized and dispatched, its token subject
subscribed: where it is long, the request waited in the client, the listening socket's
backlog or the gateway's event loop); how late the load generator sent its requests (p99 of
the send time less the arrival time, of the requests answered before the drain ended: where
it is long, the generator, which shares the cores, could not keep up); the gateway's CPU
seconds over the level and its peak RSS (VmHWM, reset before each level), and the load
generator's own CPU seconds (what the cores had left for the stack).

The gateway's ceiling: prefill-only requests (max_tokens 1), offered at `--ceiling-start`
(default: the capacity) and 1.5x more each step, until the p99 of the gateway's added latency
reaches 50 ms, a request is refused or fails (then the workers, not the gateway, are the
bound), or `--ceiling-steps` are done.

The gateway's added latency of a request, from its trace: its "request" span (the trace's
root: from the gateway sending it on to its last token handled) minus the stretch from the
start of its first worker span to the end of its last (prefill queue and run; with decode
also decode queue, kv transfer, decode run). What remains is the gateway's own work and
waiting: publishing the request and its hop into the prefill instance's queue (NATS, then
the prefill process taking it off its event loop, which waits while its engine thread holds
the GIL), then the last token's hop back and the gateway's handling of it (its event loop's
backlog included). Queueing and
computing on the workers, and the hop between them, are the workers' time, whoever is to
blame for a long queue. Not in the span: HTTP parsing, validation, tokenization and
admission before it, and writing the answer after it; the client's end-to-end p99 beside it
shows when those (or the shared CPU) grow. The load generator shares the machine's cores
with the stack.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

from distserve.bench.results import span_bounds, span_seconds
from distserve.bench.runner import read_spans
from services.launcher import Stack, StackConfig
from services.supervisor import free_port
from shared.metrics import percentiles
from shared.workloads import unit_rate_gaps

MODEL = "smollm2-135m"
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time",
           "The three primary colors are", "Water boils at", "import numpy as np\n"]
BUDGET_S = 0.050  # the gateway's added latency, p99
WORKER_SPANS = {"prefill queue", "prefill run", "decode queue", "kv transfer", "decode run"}
SPAN_FLUSH_S = 1.5  # the services export spans every 0.5 s


@dataclass
class Outcome:
    status: int  # 0: no HTTP answer (connection error or timeout)
    latency_s: float
    completed: bool  # 200 with a finish_reason
    retry_after: bool
    late_s: float = 0.0  # how long after its arrival time the request was sent
    sent_epoch: float = 0.0  # when it was sent (seconds since the epoch)
    request_id: str = ""  # the gateway's id (in its traces), of a request answered 200


@dataclass
class Level:
    name: str
    rate: float
    sent: int
    accepted: int
    completed: int
    rejected: int  # 429
    rejected_without_retry_after: int
    server_errors: int  # 5xx
    connection_errors: int
    unfinished: int  # cancelled after the drain
    p50_s: float
    p99_s: float
    gateway_cpu_s: float
    gateway_peak_rss_mb: float
    added_p50_s: float | None = None  # ceiling steps only: the gateway's added latency
    added_p99_s: float | None = None
    late_p99_s: float = 0.0  # the load generator's lateness: sends after their arrival time
    served_p50_s: float | None = None  # the accepted requests' "request" spans (gateway side)
    served_p99_s: float | None = None
    before_p50_s: float | None = None  # from the send to the gateway's "request" span
    before_p99_s: float | None = None
    generator_cpu_s: float = 0.0  # the load generator's (this process's) CPU over the level


def body(i: int, max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}


def client(timeout_s: float) -> aiohttp.ClientSession:
    """aiohttp, not httpx: with thousands of requests in flight httpx's connection pool
    costs CPU that grows faster than they do (the 10x level's 2,200-2,900 requests took it
    25-58 s of CPU on the cores the stack shares, aiohttp 2.1-2.6 s), so the generator, not
    the stack, set the latencies: requests waited up to 50 s to reach the gateway."""
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s),
                                 connector=aiohttp.TCPConnector(limit=0))


async def send(c: aiohttp.ClientSession, url: str, payload: dict[str, Any]) -> Outcome:
    start, sent_epoch = time.perf_counter(), time.time()
    try:
        async with c.post(f"{url}/v1/completions", json=payload) as r:
            status, retry_after = r.status, "Retry-After" in r.headers
            answer = await r.json() if status == 200 else {}
    except (aiohttp.ClientError, TimeoutError):
        return Outcome(0, time.perf_counter() - start, False, False, sent_epoch=sent_epoch)
    latency = time.perf_counter() - start
    completed = bool(answer) and answer["choices"][0].get("finish_reason") is not None
    return Outcome(status, latency, completed, retry_after, sent_epoch=sent_epoch,
                   request_id=answer.get("id", "").removeprefix("cmpl-"))


async def closed_loop(url: str, clients: int, duration_s: float, max_tokens: int) -> float:
    """Requests completed per second by `clients` clients, each sending its next request when
    its last one is answered, counted for `duration_s` from the moment as many requests as
    clients have completed (the first round: by then the stack is as full as it gets); what
    is in flight at the end is cancelled."""
    done: list[float] = []
    async with client(600) as c:

        async def loop(k: int) -> None:
            while True:
                outcome = await send(c, url, body(k, max_tokens))
                if not outcome.completed:
                    raise RuntimeError(f"a capacity request failed: HTTP {outcome.status}"
                                       " (429: more --clients than the gateway admits)")
                done.append(time.perf_counter())

        tasks = [asyncio.ensure_future(loop(k)) for k in range(clients)]
        try:
            while len(done) < clients or time.perf_counter() < done[clients - 1] + duration_s:
                await asyncio.sleep(0.1)
                for task in tasks:
                    if task.done():
                        task.result()  # a loop ends only by raising
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    start = done[clients - 1]
    return sum(start < t <= start + duration_s for t in done) / duration_s


async def open_loop(url: str, rate: float, duration_s: float, max_tokens: int,
                    max_requests: int, drain_s: float, seed: int) -> tuple[list[Outcome], int]:
    """Poisson arrivals at `rate` for `duration_s` (at most `max_requests`); the outcomes of
    those answered within `drain_s` after the window, and how many were not."""
    arrivals = np.cumsum(unit_rate_gaps(max_requests, np.random.default_rng(seed)) / rate)
    arrivals = arrivals[arrivals < duration_s]
    if not len(arrivals):
        return [], 0
    async with client(duration_s + drain_s) as c:
        start = time.perf_counter()

        async def one(i: int, at: float) -> Outcome:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            late_s = time.perf_counter() - start - at
            return replace(await send(c, url, body(i, max_tokens)), late_s=late_s)

        tasks = [asyncio.ensure_future(one(i, at)) for i, at in enumerate(arrivals)]
        done, pending = await asyncio.wait(tasks, timeout=duration_s + drain_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return [t.result() for t in done], len(pending)


def summarize(name: str, rate: float, outcomes: list[Outcome], unfinished: int,
              cpu_s: float, rss_mb: float) -> Level:
    accepted = [o for o in outcomes if o.status and o.status != 429]
    figures = percentiles([o.latency_s for o in accepted], (50, 99))
    late = percentiles([o.late_s for o in outcomes], (99,))["p99"] if outcomes else 0.0
    return Level(name, rate, len(outcomes) + unfinished, len(accepted) + unfinished,
                 sum(o.completed for o in outcomes), sum(o.status == 429 for o in outcomes),
                 sum(o.status == 429 and not o.retry_after for o in outcomes),
                 sum(o.status >= 500 for o in outcomes), sum(o.status == 0 for o in outcomes),
                 unfinished, figures["p50"], figures["p99"], cpu_s, rss_mb, late_p99_s=late)


class Gateway:
    """The gateway process's CPU time (from the stack) and peak RSS (from /proc)."""

    def __init__(self, stack: Stack) -> None:
        self.stack, self.pid = stack, stack.child("gateway").pid

    def cpu_s(self) -> float:
        return self.stack.cpu_seconds()["gateway"]

    def reset_peak(self) -> None:
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")  # VmHWM := current RSS

    def peak_rss_mb(self) -> float:
        status = Path(f"/proc/{self.pid}/status").read_text()
        (kb,) = re.findall(r"^VmHWM:\s+(\d+) kB", status, re.M)
        return int(kb) / 1024


def idle(url: str) -> bool:
    """Nothing in flight at the gateway and every KV block free."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    inflight = re.search(r"^ds_gateway_inflight (\S+)$", text, re.M)
    free = sum(map(float, re.findall(r"^ds_kv_free_blocks\{.*\} (\S+)$", text, re.M)))
    total = sum(map(float, re.findall(r"^ds_kv_total_blocks\{.*\} (\S+)$", text, re.M)))
    return inflight is not None and float(inflight.group(1)) == 0 and free == total > 0


def settle(url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not idle(url):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the stack did not drain within {timeout_s:.0f}s")
        time.sleep(0.5)


def run_level(stack: Stack, gateway: Gateway, name: str, rate: float, max_tokens: int,
              duration_s: float, args: argparse.Namespace, added: bool = False) -> Level:
    """One level; with `added`, also the gateway's added latency (ceiling steps)."""
    settle(stack.url)
    gateway.reset_peak()
    cpu, since, own = gateway.cpu_s(), time.time(), time.process_time()
    outcomes, unfinished = asyncio.run(open_loop(stack.url, rate, duration_s, max_tokens,
                                                 args.max_requests, args.drain, args.seed))
    own = time.process_time() - own
    settle(stack.url)
    level = summarize(name, rate, outcomes, unfinished, gateway.cpu_s() - cpu,
                      gateway.peak_rss_mb())
    time.sleep(SPAN_FLUSH_S)
    traces = read_spans(stack.run_dir)
    spans = {s["attributes"].get("request_id"): s for s in completed_requests(traces, since)}
    answered = [(o, spans[o.request_id]) for o in outcomes if o.request_id in spans]
    served = percentiles([span_seconds(s) for _, s in answered], (50, 99))
    level.served_p50_s, level.served_p99_s = served["p50"], served["p99"]
    before = percentiles([span_bounds(s)[0] - o.sent_epoch for o, s in answered], (50, 99))
    level.before_p50_s, level.before_p99_s = before["p50"], before["p99"]
    level.generator_cpu_s = own
    if added:
        gateway_s = percentiles(gateway_added_s(traces, since), (50, 99))
        level.added_p50_s, level.added_p99_s = gateway_s["p50"], gateway_s["p99"]
    print(f"{name}: {level.sent} sent, {level.completed} completed, {level.rejected} 429, "
          f"p99 {ms(level.p99_s)} ms (served {ms(level.served_p99_s)} ms, before the gateway "
          f"{ms(level.before_p99_s)} ms), sent up to "
          f"{ms(level.late_p99_s)} ms late (p99)", flush=True)
    return level


def completed_requests(spans: list[dict[str, Any]], since: float) -> list[dict[str, Any]]:
    """The "request" spans (the gateway's, one a request) of the requests that started after
    `since` (seconds since the epoch) and completed."""
    after = datetime.fromtimestamp(since, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return [s for s in spans if s["name"] == "request" and s["start_time"] > after
            and s["attributes"].get("outcome") in ("stop", "length")]


def stretch_s(spans: list[dict[str, Any]]) -> float:
    """From the first span's start to the last one's end (the stamps are ISO UTC, so they
    sort as text)."""
    return span_seconds({"start_time": min(s["start_time"] for s in spans),
                         "end_time": max(s["end_time"] for s in spans)})


def gateway_added_s(spans: list[dict[str, Any]], since: float) -> list[float]:
    """Per request completed that started after `since` (seconds since the epoch), the
    seconds of its "request" span not covered by its workers' spans (see the module's
    docstring)."""
    workers: dict[str, list[dict[str, Any]]] = {}
    for s in spans:
        if s["name"] in WORKER_SPANS:
            workers.setdefault(s["context"]["trace_id"], []).append(s)
    return [span_seconds(s) - stretch_s(workers[s["context"]["trace_id"]])
            for s in completed_requests(spans, since) if s["context"]["trace_id"] in workers]


def ceiling(stack: Stack, gateway: Gateway, start: float,
            args: argparse.Namespace) -> tuple[float | None, list[Level], str]:
    """The highest offered rate (max_tokens 1) whose gateway-added p99 stays under BUDGET_S,
    the steps, and why the search stopped."""
    best, steps, rate = None, [], start
    for _ in range(args.ceiling_steps):
        level = run_level(stack, gateway, f"{rate:.1f}/s", rate, 1, args.ceiling_duration, args,
                          added=True)
        steps.append(level)
        if (why := over(level)) is not None:
            return best, steps, why
        best, rate = rate, rate * 1.5
    return best, steps, f"{args.ceiling_steps} steps, all within the budget"


def over(step: Level) -> str | None:
    """Why a ceiling step ends the search, or None."""
    if not step.sent:
        return f"no request arrived in a step at {step.rate:.1f}/s: raise --ceiling-duration"
    if step.completed != step.sent:
        return f"requests refused or failed at {step.rate:.1f}/s (the workers are the bound)"
    if step.added_p99_s is None or not step.added_p99_s < BUDGET_S:
        return f"p99 {ms(step.added_p99_s)} ms at {step.rate:.1f}/s"
    return None


def ms(seconds: float | None) -> str:
    return "-" if seconds is None or seconds != seconds else f"{1e3 * seconds:.0f}"


def table(title: str, levels: list[Level]) -> Table:
    t = Table(title=title)
    columns = ["level", "offered/s", "sent", "accepted", "completed", "429 (no Retry-After)",
               "5xx", "conn err", "unfinished", "p50 ms", "p99 ms", "served p50/p99 ms",
               "before gw p50/p99 ms",
               "sent late p99 ms", "load gen CPU s", "gw CPU s", "gw peak MB",
               "gw added p50/p99 ms"]
    for column in columns:
        t.add_column(column, justify="right")
    for v in levels:
        t.add_row(v.name, f"{v.rate:.1f}", str(v.sent), str(v.accepted), str(v.completed),
                  f"{v.rejected} ({v.rejected_without_retry_after})", str(v.server_errors),
                  str(v.connection_errors), str(v.unfinished), ms(v.p50_s), ms(v.p99_s),
                  f"{ms(v.served_p50_s)}/{ms(v.served_p99_s)}",
                  f"{ms(v.before_p50_s)}/{ms(v.before_p99_s)}", ms(v.late_p99_s),
                  f"{v.generator_cpu_s:.1f}", f"{v.gateway_cpu_s:.1f}",
                  f"{v.gateway_peak_rss_mb:.0f}",
                  f"{ms(v.added_p50_s)}/{ms(v.added_p99_s)}")
    return t


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=15, help="seconds per load level")
    parser.add_argument("--clients", type=int, default=128,
                        help="closed-loop clients (default: the gateway's default in-flight "
                             "limit with one decode instance, 2 x its batch of 64)")
    parser.add_argument("--levels", type=float, nargs="+", default=[1, 2, 5, 10],
                        help="multiples of the capacity offered")
    parser.add_argument("--max-requests", type=int, default=3000, help="per level")
    parser.add_argument("--drain", type=float, default=60,
                        help="seconds after a level's last send before the rest is cancelled")
    parser.add_argument("--ceiling-start", type=float, help="req/s (default: the capacity)")
    parser.add_argument("--ceiling-duration", type=float, default=8)
    parser.add_argument("--ceiling-steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", type=Path, default=Path("runs"),
                        help="a new folder here gets the stack's logs, traces, overload.json")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    stack = Stack(StackConfig(port=free_port(), run_dir=args.run_dir, prefill=1, decode=1))
    stack.start()
    try:
        gateway = Gateway(stack)
        capacity = asyncio.run(closed_loop(stack.url, args.clients, args.duration, 16))
        print(f"capacity: {capacity:.2f} req/s completed ({args.clients} closed-loop clients, "
              f"max_tokens 16, {args.duration:g} s)", flush=True)
        levels = [run_level(stack, gateway, f"{m:g}x", m * capacity, 16, args.duration, args)
                  for m in args.levels]
        best, steps, why = ceiling(stack, gateway, args.ceiling_start or capacity, args)
    finally:
        stack.stop()
    console = Console(width=220)
    console.print(table("Overload, 1P+1D, max_tokens 16", levels))
    console.print(table(f"Gateway ceiling, max_tokens 1 (p99 added < {1e3 * BUDGET_S:.0f} ms)",
                        steps))
    console.print(f"gateway ceiling: {f'{best:.1f} req/s' if best else 'below the first step'}"
                  f" (stopped: {why}; --ceiling-start sets the first step)")
    out = stack.run_dir / "overload.json"
    out.write_text(json.dumps({"args": vars(args),
                               "capacity_rps": capacity, "levels": [asdict(v) for v in levels],
                               "ceiling_rps": best, "ceiling_stopped": why,
                               "ceiling_steps": [asdict(v) for v in steps]}, indent=1,
                              default=str))  # the run dir, a Path
    console.print(f"results: {out}")


if __name__ == "__main__":
    main()
