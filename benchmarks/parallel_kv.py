"""Pulling a parallel prefill instance's KV: each rank serving its own part (now) against rank 0
gathering every rank's part and serving it whole on the engine thread (before).

    .venv/bin/python benchmarks/parallel_kv.py [--tp 3] [--pp 1] [--length 512] [--pulls 8]

One process plays the prefill instance's rank 0 (its ranks are processes of their own, as in
a service) and the decode side (a KvClient on the same event loop as rank 0's listener). Two
conditions: the prefill instance idle, and busy prefilling prompts of the same length one
step after another (a service runs the old path's export on the engine thread, so it waits
for the step in progress; here a lock the step loop holds stands for that thread). Each pull
moves one request's whole KV over UCX; figures are medians of `--pulls` pulls, ms. The new
way stages both ends in reused host buffers, as the services do (`kv_cache.Staging`): every
rank's export, and the puller's landing buffer.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import secrets
import statistics
import threading
import time
from typing import Any

import torch

from shared import kv_transfer
from shared.engine.config import EngineConfig, Role
from shared.engine.engine import Engine
from shared.engine.kv_cache import Staging
from shared.engine.parallel.layout import KvSpan
from shared.engine.request import SamplingParams
from shared.kv_transfer import KvClient, KvServer, pull_pieces

PARKED = SamplingParams(max_tokens=16)  # parks after its first token


class Prefill:
    """A parallel prefill engine, its ranks listening, with rank 0's listener on a loop
    thread that serves both ways: part=None the old way (every rank's part gathered through
    rank 0, under the engine's lock), a part the new way (rank 0's own, off the engine)."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine = Engine(config.with_scheduler(role=Role.PREFILL))
        self.lock = threading.Lock()  # the engine thread: steps and the old path's exports
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        kv_transfer.enable_notifier_thread()
        # the new way stages both ends on the CPU as the services do (rank 0's export, the
        # pull); the old way's exports are its own
        self.exports, self.landings = Staging(), Staging()
        self.staged = self.engine.runner.device.type == "cpu"
        self.lent: set[int] = set()  # the exports' staging buffers, until sent
        self.server = KvServer(lookup=self._lookup, key=secrets.token_bytes(32),
                               sent=self._sent)
        self.run(self._listen())
        addresses = [self.server.address,
                     *self.engine.serve_kv("127.0.0.1", self.server.key)]
        self.sources = list(zip(addresses, self.engine.runner.kv_spans, strict=True))
        self.client = KvClient(timeout_s=120)
        self.ids = itertools.count()

    def run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    async def _listen(self) -> None:
        self.server.start()

    async def _lookup(self, request_id: str, part: KvSpan | None, skip: int) -> Any:
        buffer = await asyncio.to_thread(self._export, request_id, part)
        return None if buffer is None else kv_transfer.wire(buffer)

    def _export(self, request_id: str, part: KvSpan | None) -> torch.Tensor | None:
        if part is None:
            with self.lock:
                return self.engine.export_kv(request_id)
        buffer = self.engine.export_part(request_id, part,
                                         self.exports.take if self.staged else None)
        if self.staged and buffer is not None:
            self.lent.add(buffer.untyped_storage().data_ptr())
        return buffer

    def _sent(self, sent: Any) -> None:
        lent = kv_transfer.unwire(sent)
        if lent is not None and lent.untyped_storage().data_ptr() in self.lent:
            self.lent.discard(lent.untyped_storage().data_ptr())  # not the old way's
            self.exports.give(lent)

    def park(self, prompt: list[int]) -> str:
        """A prompt prefilled and parked (under the lock: the engine is not thread-safe)."""
        request_id = f"p{next(self.ids)}"
        with self.lock:
            self.engine.add_request(request_id, prompt, PARKED)
        while request_id not in self.engine.scheduler.parked:
            with self.lock:
                self.engine.step()
            time.sleep(0.001)  # an export asked for meanwhile runs next, as on a service
        return request_id

    def pull_ms(self, request_id: str, whole: bool) -> float:
        buffer = self.engine.runner.kv_buffer(
            len(self.engine.scheduler.parked[request_id].block_table),
            self.landings.take if self.staged and not whole else None)
        token = self.server.token(request_id)
        start = time.perf_counter()
        if whole:
            self.run(self.client.pull(self.server.address, request_id, token,
                                         kv_transfer.wire(buffer)))
        else:
            self.run(pull_pieces(self.client, request_id, token, self.sources,
                                 KvSpan.whole(self.engine.model_config), buffer))
            if self.staged:
                self.landings.give(buffer)
        return (time.perf_counter() - start) * 1e3

    def close(self) -> None:
        async def close() -> None:
            await self.client.close()
            self.server.close()
            kv_transfer.stop_notifier_thread()

        self.run(close())
        self.engine.close()


def busy(prefill: Prefill, prompt: list[int], stop: threading.Event) -> None:
    """Prefill prompts one step after another, each freed once parked."""
    while not stop.is_set():
        request_id = prefill.park(prompt)
        with prefill.lock:
            prefill.engine.release(request_id)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tp", type=int, default=3)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--length", type=int, default=512, help="prompt tokens a request")
    parser.add_argument("--pulls", type=int, default=8, help="pulls a figure")
    parser.add_argument("--threads", type=int, default=0, help="the instance's (0: all)")
    args = parser.parse_args()
    config = dataclasses.replace(EngineConfig(model=args.model, threads=args.threads,
                                              kv_cache_bytes=1 << 30), tp=args.tp, pp=args.pp)
    prefill = Prefill(config)
    try:
        vocab = prefill.engine.model_config.vocab_size
        prompt = torch.randint(0, vocab, (args.length,),
                               generator=torch.Generator().manual_seed(0)).tolist()
        parked = [prefill.park(prompt) for _ in range(args.pulls)]
        nbytes = prefill.engine.export_kv(parked[0]).nbytes
        print(f"{args.model}, tp {args.tp} pp {args.pp}, {args.length}-token prompts: "
              f"{nbytes / 1e6:.1f} MB of KV a request, {len(prefill.sources)} listeners")
        rows = []
        for condition in ("idle", "busy"):
            stop = threading.Event()
            loader = threading.Thread(target=busy, args=(prefill, prompt, stop))
            if condition == "busy":
                loader.start()
                time.sleep(1.0)
            figures: dict[bool, list[float]] = {True: [], False: []}
            for request_id in parked:  # alternately: both meet the same host
                for whole in (True, False):
                    figures[whole].append(prefill.pull_ms(request_id, whole))
            stop.set()
            if loader.is_alive():
                loader.join()
            before, after = (statistics.median(figures[w]) for w in (True, False))
            rows.append((condition, before, after))
        print("| prefill instance | through rank 0 (before) | each rank its part (now) | "
              "before / now |\n| --- | ---: | ---: | ---: |")
        for condition, before, after in rows:
            print(f"| {condition} | {before:,.1f} ms | {after:,.1f} ms | "
                  f"{before / after:.2f}x |")
    finally:
        prefill.close()


if __name__ == "__main__":
    main()
