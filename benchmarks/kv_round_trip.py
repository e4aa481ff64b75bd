"""A request's KV between two processes over UCX on one device kind, as the services move it
(GPU memory to GPU memory on a GPU machine: the path that never crosses the host).

    python benchmarks/kv_round_trip.py --model llama-3-8b --device cuda --lengths 128 512 2048
    UCX_TLS=^cuda_ipc python benchmarks/kv_round_trip.py ...  # staged through the host
    .venv/bin/python benchmarks/kv_round_trip.py --model tiny   # the same on the CPU

The prefill process prefills each prompt, parks it and serves its KV as the prefill service
does (`export_part`, then synchronised, behind a `KvServer`); the decode process takes it as
the decode service does (`allocate`, `kv_buffer`, `pull_pieces` into the buffer, then
`admit_imported`) and decodes on. Checked: the bytes that land are the bytes exported
(SHA-256 on both sides), and the greedy tokens equal those of a colocated engine on the same
weights (one request at a time, so each step has the same shapes on both paths). Figures:
each pull's time and rate by prompt length (median of `--pulls`, after a pull that opens the
endpoint). `UCX_PROTO_INFO=y` makes UCX print the protocols it picks (cuda_ipc: GPU to GPU).
Exits 1 if any bytes or tokens differ.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import multiprocessing as mp
import statistics
import sys
import time
from typing import Any

import torch

from shared import kv_transfer
from shared.engine.config import EngineConfig, Role
from shared.engine.engine import Engine
from shared.engine.parallel.layout import KvSpan
from shared.engine.request import Request, SamplingParams
from shared.kv_transfer import KvClient, KvServer, pull_pieces


@dataclasses.dataclass
class Parked:
    """What a KvReady tells the decode side, and what the check needs."""

    request_id: str
    prompt: list[int]
    first: int  # the token the prefill sampled
    num_blocks: int
    token: str
    sha256: str  # of the KV bytes exported
    reference: list[int]  # the colocated engine's tokens for this prompt


def digest(buffer: torch.Tensor) -> str:
    return hashlib.sha256(buffer.contiguous().cpu().view(torch.uint8).numpy()).hexdigest()


def prompts(lengths: list[int], pulls: int, vocab: int) -> list[tuple[str, list[int]]]:
    gen = torch.Generator().manual_seed(0)
    out = [("warm-up", torch.randint(0, vocab, (lengths[0],), generator=gen).tolist())]
    for length in lengths:
        out += [(f"len{length}-{i}", torch.randint(0, vocab, (length,), generator=gen).tolist())
                for i in range(pulls)]
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def prefill_side(config: EngineConfig, lengths: list[int], pulls: int, tokens: int,
                 out: Any, stop: Any) -> None:
    """The prefill process: the colocated reference first (then freed), the prefill engine's
    parked requests, then their KV served until told to stop."""
    greedy = SamplingParams(max_tokens=tokens, ignore_eos=True)
    reference_engine = Engine(config.with_scheduler(role=Role.COLOCATED))
    work = prompts(lengths, pulls, reference_engine.model_config.vocab_size)
    reference = {}
    for request_id, prompt in work:  # one at a time: the shapes the disaggregated path meets
        reference[request_id] = reference_engine.generate([prompt], greedy)[0].output_ids
    reference_engine.close()
    del reference_engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    engine = Engine(config.with_scheduler(role=Role.PREFILL))
    device = engine.runner.device

    async def lookup(request_id: str, part: KvSpan | None, skip: int) -> Any:
        """As the service does: the copy, synchronised before UCX reads it (every prompt is
        parked before the first pull, so no step runs meanwhile)."""
        buffer = engine.export_part(request_id, part, skip=skip)
        if buffer is None:
            return None
        sync(device)
        return kv_transfer.wire(buffer)

    parked = []
    for request_id, prompt in work:
        engine.add_request(request_id, prompt, greedy)
        first: list[int] = []
        while request_id not in engine.scheduler.parked:
            for output in engine.step():
                assert output.error is None, output.error
                first += output.new_token_ids
        blocks = engine.scheduler.parked[request_id].block_table
        parked.append(Parked(request_id, prompt, first[0], len(blocks), "",
                             digest(engine.export_kv(request_id)), reference[request_id]))

    async def serve() -> None:
        kv_transfer.enable_notifier_thread()
        server = KvServer(lookup=lookup)
        server.start()
        for p in parked:
            p.token = server.token(p.request_id)
        out.put((server.address, engine.runner.kv_spans[0], parked))
        while not stop.is_set():
            await asyncio.sleep(0.05)
        out.put(server.stats.bytes)
        server.close()
        kv_transfer.stop_notifier_thread()

    asyncio.run(serve())
    engine.close()


def decode_side(config: EngineConfig, address: str, span: KvSpan, parked: list[Parked],
                tokens: int) -> tuple[dict[str, float], list[str]]:
    """Pull, check and decode each parked request: its pull's seconds, and what differed."""
    engine = Engine(config.with_scheduler(role=Role.DECODE))
    device = engine.runner.device
    greedy = SamplingParams(max_tokens=tokens, ignore_eos=True)
    seconds: dict[str, float] = {}
    wrong: list[str] = []

    async def run() -> None:
        kv_transfer.enable_notifier_thread()
        client = KvClient(timeout_s=120)
        for p in parked:
            computed = len(p.prompt)
            blocks = engine.allocate(computed)
            assert blocks is not None and len(blocks) == p.num_blocks, "the decode pool is full"
            buffer = engine.kv_buffer(len(blocks))
            sync(device)  # the buffer exists before UCX writes it
            start = time.perf_counter()
            await pull_pieces(client, p.request_id, p.token, [(address, span)],
                              engine.runner.kv_spans[0], buffer)
            seconds[p.request_id] = time.perf_counter() - start
            if digest(buffer) != p.sha256:
                wrong.append(f"{p.request_id}: KV bytes differ")
            request = Request(p.request_id, p.prompt, greedy, eos_ids=engine.eos_ids,
                              output_ids=[p.first])
            engine.admit_imported(request, blocks, buffer)
            while engine.has_work():
                for output in engine.step():
                    assert output.error is None, output.error
            if request.output_ids != p.reference:
                same = sum(a == b for a, b in zip(request.output_ids, p.reference,
                                                  strict=False))
                wrong.append(f"{p.request_id}: tokens differ ({same}/{len(p.reference)} "
                             f"agree)")
        await client.close()
        kv_transfer.stop_notifier_thread()

    asyncio.run(run())
    engine.close()
    return seconds, wrong


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="a LLAMA_SHAPES key or model name")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--pulls", type=int, default=4, help="pulls a prompt length")
    parser.add_argument("--tokens", type=int, default=8, help="tokens each request generates")
    parser.add_argument("--kv-cache-mb", type=int, default=1024, help="each engine's pool")
    args = parser.parse_args()
    config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                          kv_cache_bytes=args.kv_cache_mb << 20)
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    prefill = ctx.Process(target=prefill_side, daemon=True,
                          args=(config, args.lengths, args.pulls, args.tokens, out, stop))
    prefill.start()
    try:
        address, span, parked = out.get(timeout=900)
        seconds, wrong = decode_side(config, address, span, parked, args.tokens)
        stop.set()
        served = out.get(timeout=60)
    finally:
        stop.set()
        prefill.join(timeout=60)
        if prefill.is_alive():
            prefill.kill()
    block_bytes = served // sum(p.num_blocks for p in parked)  # every block the same size
    print(f"{args.model} on {args.device} ({config.dtype}), {len(parked)} requests, "
          f"{served / 1e6:,.1f} MB served; the first pull (opens the endpoint): "
          f"{seconds['warm-up'] * 1e3:.2f} ms")
    print("| prompt tokens | KV a request | pull, median | rate | pulls |\n"
          "| ---: | ---: | ---: | ---: | ---: |")
    for length in args.lengths:
        mine = [p for p in parked if p.request_id.startswith(f"len{length}-")]
        size = mine[0].num_blocks * block_bytes
        median = statistics.median(seconds[p.request_id] for p in mine)
        print(f"| {length} | {size / 1e6:,.2f} MB | {median * 1e3:.2f} ms | "
              f"{size / median / 1e9:.2f} GB/s | {len(mine)} |")
    if wrong:
        print("DIFFERENCES:\n  " + "\n  ".join(wrong))
        return 1
    print(f"every request's KV arrived bit for bit and its {args.tokens} greedy tokens equal "
          "the colocated engine's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
