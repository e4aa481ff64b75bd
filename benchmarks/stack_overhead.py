"""What the services cost over the in-process engine, and what the KV transfer costs.

    .venv/bin/python benchmarks/stack_overhead.py [--requests 8] [--prompt-tokens 256]

Measured in one run, one request at a time, the same engine settings (1 thread) in both:
- TTFT and TPOT of a request through the stack (1 prefill + 1 decode, OpenAI streaming
  client) against the in-process engine (colocated role, same prompt, greedy, ignore_eos);
- per request, the KV transfer span (decode's pull over UCX) against the request's total
  latency, from the traces;
- the UCX transfer rate of a request's blocks against a local memory copy of the same size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import openai
import torch

from services.launcher import Stack, StackConfig
from services.supervisor import free_port
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.request import SamplingParams


def in_process(engine: Engine, ids: list[int], tokens: int) -> tuple[float, float]:
    start = time.perf_counter()
    engine.add_request(f"r{start}", ids, SamplingParams(max_tokens=tokens, ignore_eos=True))
    times = []
    while engine.has_work():
        if engine.step():
            times.append(time.perf_counter())
    return times[0] - start, (times[-1] - times[0]) / (len(times) - 1)


def through_stack(client: openai.OpenAI, ids: list[int], tokens: int) -> tuple[float, float]:
    start = time.perf_counter()
    times = []
    for chunk in client.completions.create(model="smollm2-135m", prompt=ids, max_tokens=tokens,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
    return times[0] - start, (times[-1] - times[0]) / (len(times) - 1)


def spans(run_dir: Path) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for p in run_dir.glob("traces-*.jsonl")
            for line in p.read_text().splitlines()]


def seconds(span: dict) -> float:  # type: ignore[type-arg]
    def parse(t: str) -> float:
        return time.mktime(time.strptime(t[:19], "%Y-%m-%dT%H:%M:%S")) + float("0" + t[19:-1])
    return parse(span["end_time"]) - parse(span["start_time"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = Engine(EngineConfig(threads=1))
    prompts = [torch.randint(100, 40000, (args.prompt_tokens,),
                             generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(args.requests)]
    local = [in_process(engine, p, args.output_tokens) for p in prompts]
    del engine
    run_dir = Path(tempfile.mkdtemp(prefix="stack-overhead-"))
    stack = Stack(StackConfig(port=free_port(), run_dir=run_dir, threads=1))
    stack.start()
    try:
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="-")
        through_stack(client, prompts[0], 4)  # warm-up
        remote = [through_stack(client, p, args.output_tokens) for p in prompts]
        time.sleep(2)  # let the span exporters flush
        all_spans = spans(stack.run_dir)
    finally:
        stack.stop()
    transfers = [s for s in all_spans if s["name"] == "kv transfer"][-args.requests:]
    totals = [s for s in all_spans if s["name"] == "request"][-args.requests:]
    nbytes = statistics.median(s["attributes"]["bytes"] for s in transfers)
    transfer_s = statistics.median(seconds(s) for s in transfers)
    total_s = statistics.median(seconds(s) for s in totals)
    src = torch.ones(int(nbytes) // 4)
    dst = torch.empty_like(src)
    copies = []
    for _ in range(20):
        t = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - t)
    copy_s = statistics.median(copies)
    med = statistics.median
    print(f"{args.requests} requests, {args.prompt_tokens}-token prompts, "
          f"{args.output_tokens} output tokens, 1 thread per worker")
    print(f"TTFT  in-process {1e3 * med(t for t, _ in local):8.1f} ms | stack "
          f"{1e3 * med(t for t, _ in remote):8.1f} ms | ratio "
          f"{med(t for t, _ in remote) / med(t for t, _ in local):.2f}")
    print(f"TPOT  in-process {1e3 * med(p for _, p in local):8.1f} ms | stack "
          f"{1e3 * med(p for _, p in remote):8.1f} ms | ratio "
          f"{med(p for _, p in remote) / med(p for _, p in local):.2f}")
    print(f"KV transfer {1e3 * transfer_s:.2f} ms of a {1e3 * total_s:.0f} ms request "
          f"({100 * transfer_s / total_s:.2f}%), {nbytes / 1e6:.2f} MB per request")
    print(f"UCX {nbytes / transfer_s / 1e9:.2f} GB/s vs local copy "
          f"{nbytes / copy_s / 1e9:.2f} GB/s of the same size "
          f"(ratio {copy_s / transfer_s:.2f})")


if __name__ == "__main__":
    main()
