"""Prefix caching's worth on this host: time to the first token of prompts that start as an
earlier one, on an engine that caches prefixes and one that computes every prompt whole (the
same model copy), interleaved round by round so the host's moments fall on both.

Two workloads: questions after one shared system prompt (`--system` tokens, then
`--question` of their own), and a conversation whose every turn sends the turns before it
again, each answer and question `--turn` tokens. Token ids are random: what is measured is
the prefill's length, not the text.

    .venv/bin/python benchmarks/prefix_cache.py [--threads 2] [--system 1024] [--question 32]
        [--turns 6] [--turn 64] [--rounds 5]

With `--stack`, the first workload through two stacks of 1 prefill + 1 decode instance (a
worker's default thread each), one with the cache and one started with
--no-prefix-caching, both up at once and asked in turns, one request at a time: the
time to the first streamed token at the client (the gateway, NATS and the prefill
instance's step), the time from it to the second (the decode instance's pull of the KV,
its import and its first step: with the cache it pulls only the blocks after those it
holds), and the KV bytes the decode instance pulled per request (its /metrics).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch
from rich.console import Console
from rich.table import Table

from distserve.bench import scrape
from distserve.bench.engine import rounds
from services.launcher import Stack, StackConfig
from services.supervisor import free_port
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.model_runner import load_model
from shared.engine.request import SamplingParams

FIRST_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)
ids = itertools.count()


def tokens(n: int, salt: int) -> list[int]:
    gen = torch.Generator().manual_seed(salt)
    return torch.randint(100, 40000, (n,), generator=gen).tolist()


def first_token_ms(engine: Engine, prompt: list[int]) -> float:
    """ms from a prompt's arrival to its first token (alone on the engine)."""
    start = time.perf_counter()
    engine.add_request(f"r{next(ids)}", prompt, FIRST_TOKEN)
    while engine.has_work():
        engine.step()
    return (time.perf_counter() - start) * 1e3


def streamed_ms(url: str, prompt: list[int]) -> tuple[float, float] | None:
    """ms from sending a completion of `prompt` (token ids) to its first streamed token, and
    from that to its second; None where the first token's text was held back (part of a
    character), so that both came in one chunk."""
    body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": 2, "stream": True,
            "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    arrived = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                arrived.append((time.perf_counter() - start) * 1e3)
    return (arrived[0], arrived[1] - arrived[0]) if len(arrived) == 2 else None


def pulled_bytes(url: str) -> float:
    """The KV bytes the stack's decode instances have pulled (as their last heartbeats
    said)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(value for labels, value in scrape.samples(text, "ds_kv_transfer_bytes_total")
               if labels.get("role") == "decode")


def through_stacks(args: argparse.Namespace) -> None:
    runs = Path(tempfile.mkdtemp(prefix="prefix-cache-"))
    stacks = {caching: Stack(StackConfig(port=free_port(), run_dir=runs / str(caching),
                                         prefix_caching=caching))
              for caching in (True, False)}
    try:
        for stack in stacks.values():
            stack.start(timeout=600)
        system = tokens(args.system, 0)
        salts = itertools.count(1)
        gaps: dict[bool, list[float]] = {True: [], False: []}
        sent = dict.fromkeys(stacks, 0)

        def ask(caching: bool) -> float:
            for _ in range(10):  # questions whose first token has text of its own
                sent[caching] += 1
                timed = streamed_ms(stacks[caching].url,
                                    system + tokens(args.question, next(salts)))
                if timed is not None:
                    gaps[caching].append(timed[1])
                    return timed[0]
            raise RuntimeError("10 questions in a row streamed their first two tokens as one")

        for caching in stacks:  # the system prompt's first request, then the pulls' bytes
            ask(caching)
        time.sleep(2)  # the decode instances' heartbeats since
        before = {caching: pulled_bytes(stack.url) for caching, stack in stacks.items()}
        first_sent = dict(sent)
        cached, whole = (statistics.median(t) for t in rounds(
            [lambda: ask(True), lambda: ask(False)], args.rounds))
        time.sleep(2)  # the decode instances' last heartbeats
        mb = {caching: (pulled_bytes(stack.url) - before[caching]) / 1e6
              / (sent[caching] - first_sent[caching]) for caching, stack in stacks.items()}
    finally:
        for stack in stacks.values():
            stack.stop()
    gap_cached, gap_whole = (statistics.median(gaps[caching][2:])  # but the warm-ups'
                             for caching in (True, False))
    table = Table(title=f"through the stack (1 prefill + 1 decode, 1 thread each), "
                        f"{args.system}-token system prompt + {args.question}: medians of "
                        f"{args.rounds} interleaved rounds")
    for column in ("", "cached", "computed whole", "whole / cached"):
        table.add_column(column, justify="right")
    table.add_row("first streamed token, ms", f"{cached:.1f}", f"{whole:.1f}",
                  f"{whole / cached:.2f}x")
    table.add_row("first to second token, ms", f"{gap_cached:.1f}", f"{gap_whole:.1f}",
                  f"{gap_whole / gap_cached:.2f}x")
    table.add_row("KV pulled, MB a request", f"{mb[True]:.2f}",
                  f"{mb[False]:.2f}", f"{mb[False] / max(mb[True], 1e-9):.1f}x")
    Console().print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--system", type=int, default=1024, help="shared system prompt tokens")
    parser.add_argument("--question", type=int, default=32, help="tokens of each question")
    parser.add_argument("--turns", type=int, default=6, help="turns of the conversation")
    parser.add_argument("--turn", type=int, default=64, help="tokens of an answer, a question")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--stack", action="store_true",
                        help="through two stacks (with and without the cache) instead")
    args = parser.parse_args()
    if args.stack:
        through_stacks(args)
        return
    torch.set_num_threads(args.threads)
    loaded = load_model(EngineConfig(model=args.model))
    longest = max(args.system + args.question, 2 * args.turns * args.turn)
    engines = {caching: Engine(EngineConfig(model=args.model).with_scheduler(
        prefix_caching=caching, max_batch_tokens=longest), loaded) for caching in (True, False)}
    system = tokens(args.system, 0)
    salts = itertools.count(1)

    def questions(caching: bool) -> float:
        salt = next(salts)  # a new question each call; the same system prompt every time
        return first_token_ms(engines[caching], system + tokens(args.question, salt))

    def conversation(caching: bool) -> float:
        """The mean first-token ms of turns 2.. of a new conversation."""
        salt, history, times = next(salts), [], []
        for turn in range(args.turns):
            history += tokens(args.turn, salt * 100 + 2 * turn)  # the user's question
            ms = first_token_ms(engines[caching], history)
            times.append(ms)
            history += tokens(args.turn, salt * 100 + 2 * turn + 1)  # the answer
        return statistics.mean(times[1:])

    table = Table(title=f"{args.model}, {args.threads} thread(s): first-token ms, medians "
                        f"of {args.rounds} interleaved rounds")
    for column in ("workload", "cached", "computed whole", "whole / cached", "tokens found"):
        table.add_column(column, justify="right")
    workloads = [(f"{args.system}-token system prompt + {args.question}", questions),
                 (f"conversation, turns 2-{args.turns} of {args.turn}+{args.turn}",
                  conversation)]
    for name, run in workloads:
        engine = engines[True]
        queried, hits = engine.scheduler.prefix_queried, engine.scheduler.prefix_hits
        cached, whole = (statistics.median(t) for t in rounds(
            [lambda run=run: run(True), lambda run=run: run(False)], args.rounds))
        found = (engine.scheduler.prefix_hits - hits) / \
            max(1, engine.scheduler.prefix_queried - queried)
        table.add_row(name, f"{cached:.1f}", f"{whole:.1f}", f"{whole / cached:.2f}x",
                      f"{found:.0%}")
    Console().print(table)


if __name__ == "__main__":
    main()
