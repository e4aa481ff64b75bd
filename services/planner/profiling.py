"""`distserve profile`: run the engine over a grid of prefill batches and decode steps, fit
the latency model and find L_m. The only planner module that touches a device."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.planner.fitting import DecodePoint, PrefillPoint, fit_phase
from services.planner.models import MODELS, from_config
from services.planner.profiles import Profile, saturation_length
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.request import SamplingParams
from shared.host import cpu_description


@dataclass(frozen=True)
class Grid:
    prefill_lengths: tuple[int, ...] = (16, 32, 64, 128, 256, 384, 512, 768, 1024)
    prefill_batches: tuple[int, ...] = (1, 2, 4)
    max_prefill_tokens: int = 2048
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 48)
    decode_contexts: tuple[int, ...] = (64, 256, 512)
    repeats: int = 3

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """(length, batch) of every prefill point, at most `max_prefill_tokens` a batch."""
        return [(length, batch) for length in self.prefill_lengths
                for batch in self.prefill_batches if length * batch <= self.max_prefill_tokens]

    @property
    def points(self) -> int:
        return len(self.prefill_shapes()) + len(self.decode_batches) * len(self.decode_contexts)

    @classmethod
    def quick(cls) -> Grid:
        return cls((32, 64, 128, 256, 512), (1, 2), 1024, (1, 2, 4, 8, 16, 32), (64, 256), 5)


def _prompt(length: int, vocab: int, salt: int) -> list[int]:
    gen = torch.Generator().manual_seed(length * 7919 + salt)
    return torch.randint(100, vocab - 100, (length,), generator=gen).tolist()


class Profiler:
    def __init__(self, engine: Engine, grid: Grid) -> None:
        self.engine, self.grid = engine, grid
        self._ids = iter(range(10**9))

    def _add(self, length: int, max_tokens: int, salt: int) -> str:
        rid = f"prof-{next(self._ids)}"
        vocab = self.engine.model_config.vocab_size
        self.engine.add_request(rid, _prompt(length, vocab, salt),
                                SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        return rid

    def prefill_point(self, length: int, batch: int) -> PrefillPoint:
        def once() -> float:
            for i in range(batch):
                self._add(length, 1, i)
            start = time.perf_counter()
            self.engine.step()
            return (time.perf_counter() - start) * 1e3
        once()  # warm-up
        # the fastest repeat: other processes on a shared machine only ever add time
        return PrefillPoint((length,) * batch, min(once() for _ in range(self.grid.repeats)))

    def decode_point(self, batch: int, context: int) -> DecodePoint:
        steps = self.grid.repeats + 2
        ids = [self._add(context, steps + 2, i) for i in range(batch)]
        requests = [self.engine.scheduler.get(rid) for rid in ids]
        while any(r is not None and not r.output_ids for r in requests):
            self.engine.step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            self.engine.step()
            times.append((time.perf_counter() - start) * 1e3)
        for rid in ids:
            self.engine.abort(rid)
        return DecodePoint(batch, batch * (context + 2), min(times[1:]))

    def run(self, progress: Callable[[str], None]) -> tuple[list[PrefillPoint],
                                                              list[DecodePoint]]:
        g = self.grid
        prefill = []
        for length, batch in g.prefill_shapes():
            progress(f"prefill {batch} x {length} tokens")
            prefill.append(self.prefill_point(length, batch))
        decode = []
        for context in g.decode_contexts:
            for batch in g.decode_batches:
                progress(f"decode batch {batch} at context {context}")
                decode.append(self.decode_point(batch, context))
        return prefill, decode


def device_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    return f"cpu-{torch.get_num_threads()}threads"


def profile_engine(config: EngineConfig, grid: Grid,
                   progress: Callable[[str], None] = lambda _: None) -> Profile:
    biggest = max(grid.max_prefill_tokens,
                  max(grid.decode_batches) * (max(grid.decode_contexts) + grid.repeats + 8))
    config = config.with_scheduler(max_batch_tokens=grid.max_prefill_tokens,
                                   max_running=max(max(grid.decode_batches),
                                                   max(grid.prefill_batches)))
    engine = Engine(config)
    try:
        dtype_bytes = engine.runner.dtype.itemsize
        spec = MODELS.get(config.model) or from_config(engine.model_config, dtype_bytes)
        needed = biggest * engine.model_config.kv_bytes_per_token(dtype_bytes)
        have = engine.blocks.num_blocks * engine.blocks.block_size * \
            engine.model_config.kv_bytes_per_token(dtype_bytes)
        if have < needed:
            raise ValueError(f"the profiling grid needs a KV pool of {needed / 2**20:.0f} MiB, "
                             f"the budget holds {have / 2**20:.0f} MiB: raise --kv-cache-mb")
        prefill, decode = Profiler(engine, grid).run(progress)
    finally:
        engine.close()
    coefficients, report = fit_phase(prefill, decode)
    return Profile(model=spec, device=device_name(engine.runner.device),
                   device_memory_bytes=device_memory_bytes(engine.runner.device),
                   by_tp={config.tp: coefficients}, l_m=saturation_length(coefficients),
                   fit=report, host=cpu_description() if engine.runner.device.type == "cpu"
                   else "")
