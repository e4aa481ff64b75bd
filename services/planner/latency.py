"""The paper's Appendix A latency model in fitted form (milliseconds):

    prefill batch, prompt lengths l_i:        a + b * sum(l_i) + c * sum(l_i^2)
    decode step, B requests, contexts c_i:    a + b * sum(c_i) + c * B

the sum of squares being prefill attention and the constant the weight-reading GEMMs of
decode. A chunk of n tokens continuing a prompt whose first k tokens are cached (chunked
prefill) adds d * n * k, its attention to the cached keys (`prefill_cached`): fitted on whole
prompts alone, c takes only part of attention's cost (the GEMMs' cost a token falls with
the prompt's length too, and the two trade off). Coefficients are measured per (model,
device, dtype, tensor parallelism). Pipeline parallelism, as the paper models it, splits a
batch's time over `pp` stages: a stage is busy time/pp, and a request still takes the full
time plus a per-stage overhead. Where a pipeline
was measured as the engine runs it (`rounds`: `distserve profile --pp`), its coefficients
price a prompt batch's whole latency and a decode round (a token for every request) as they
are: the engine runs a round as `pp` micro-batches, each stage reading its weights once a
micro-batch, which the paper's division by `pp` does not see.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

Triple = tuple[float, float, float]


@dataclass(frozen=True)
class PhaseCoefficients:
    prefill: Triple
    decode_small: Triple
    decode_large: Triple
    decode_threshold: int = 1 << 30  # batch size from which `decode_large` applies
    # a pipeline measured as it runs: how long its slowest stage is busy with a prompt, as a
    # share of the prompt's latency (0: not measured, the paper's 1 / pp)
    prefill_stage: float = 0.0
    # d: ms per new prompt token and token cached before it in the same prompt (a chunk
    # continuing a prompt); None: not measured, priced at the quadratic term c
    prefill_cached: float | None = None

    @property
    def cached_ms(self) -> float:
        """d, or c where it was not measured."""
        return self.prefill[2] if self.prefill_cached is None else self.prefill_cached

    def scaled(self, speedup: float) -> PhaseCoefficients:
        """All times divided by `speedup` (e.g. an intra-op speedup K)."""

        def div(t: Triple) -> Triple:
            return (t[0] / speedup, t[1] / speedup, t[2] / speedup)

        return dataclasses.replace(self, prefill=div(self.prefill),
                                   decode_small=div(self.decode_small),
                                   decode_large=div(self.decode_large),
                                   prefill_cached=_times(self.prefill_cached, 1 / speedup))

    def slowed(self, prefill: float, decode: float, prefill_ms: float = 0.0,
               decode_ms: float = 0.0) -> PhaseCoefficients:
        """Prefill times multiplied by `prefill` plus `prefill_ms` a step, decode times by
        `decode` plus `decode_ms` a step."""

        def mul(t: Triple, k: float, plus: float) -> Triple:
            return (max(0.0, t[0] * k + plus), t[1] * k, t[2] * k)

        return dataclasses.replace(self, prefill=mul(self.prefill, prefill, prefill_ms),
                                   decode_small=mul(self.decode_small, decode, decode_ms),
                                   decode_large=mul(self.decode_large, decode, decode_ms),
                                   prefill_cached=_times(self.prefill_cached, prefill))


def _times(value: float | None, k: float) -> float | None:
    return None if value is None else value * k


def chunk_terms(chunks: Iterable[tuple[int, int]]) -> tuple[int, int, int]:
    """The prefill model's terms of a prompt step's chunks, each (new tokens, tokens of its
    prompt cached before them): (sum of new tokens, sum of their squares, sum of new tokens
    times cached ones), as `LatencyModel.prefill_ms` takes them."""
    pairs = list(chunks)
    return (sum(n for n, _ in pairs), sum(n * n for n, _ in pairs),
            sum(n * k for n, k in pairs))


Phase = Literal["prefill", "decode"]
PHASES: tuple[Phase, Phase] = ("prefill", "decode")


@dataclass(frozen=True)
class Contention:
    """How much longer a step of one phase takes while another device of the same host runs
    a step of a phase: factors >= 1, measured by `distserve profile` with a second engine
    beside the profiled one. CPU cores share the memory bandwidth and the last-level cache:
    on 2-vCPU Zen 4 EPYC hosts a batch-1 decode step took 1.16-1.55x as long beside a
    decoding engine (both stream the weights; four runs) and 1.00-1.06x beside a prefilling
    one, while the engine alone shows nothing of it. 1.0 (the default) for devices that
    share nothing (GPUs). A factor is of the whole step, whatever its batch: on a 2-vCPU Zen 3
    EPYC's recorded runs (six, three systems each) a decode step beside a prefilling
    neighbour ran 1.02-1.09x at every batch from 1 to 12, and beside a decoding one
    1.27-1.36x at every batch from 1 to 4 (docs/benchmarks.md)."""

    decode_by_decode: float = 1.0
    decode_by_prefill: float = 1.0
    prefill_by_decode: float = 1.0
    prefill_by_prefill: float = 1.0

    def factor(self, phase: Phase, beside: Iterable[Phase]) -> float:
        """A `phase` step's slowdown beside steps of the phases `beside`: each neighbour
        adds its own (memory traffic adds up)."""
        return 1.0 + sum(float(getattr(self, f"{phase}_by_{other}")) - 1.0 for other in beside)

    @property
    def none(self) -> bool:
        return self == Contention()


@dataclass(frozen=True)
class LatencyModel:
    coefficients: PhaseCoefficients
    pp: int = 1
    stage_overhead_ms: float = 0.0
    contention: Contention = field(default_factory=Contention)
    rounds: bool = False  # coefficients measured on this pipeline: whole latencies and rounds

    def prefill_ms(self, sum_len: float, sum_sq: float, cached: float = 0.0) -> float:
        """A prompt step: `sum_len` new tokens, `sum_sq` the sum of each prompt's (or chunk's)
        new tokens squared, `cached` the sum of each chunk's new tokens times the tokens of
        its prompt cached before it."""
        co = self.coefficients
        a, b, c = co.prefill
        return a + b * sum_len + c * sum_sq + co.cached_ms * cached

    def decode_ms(self, batch: int, sum_ctx: float) -> float:
        co = self.coefficients
        a, b, c = co.decode_large if batch >= co.decode_threshold else co.decode_small
        return a + b * sum_ctx + c * batch

    def riding_ms(self, batch: int, sum_ctx: float) -> float:
        """What `batch` decodes add to a step that computes prompt tokens anyway (chunked
        prefill): the decode model's cost per request and per context token, without its
        constant, from the large-batch fit (the small-batch fit's per-request slope carries
        the fixed costs of tiny steps). On the development VM (Intel, 1 thread) each decode
        at a 200-token context added 3-5 ms to a prefill chunk; a prompt token costs 1.25."""
        _, per_ctx, per_request = self.coefficients.decode_large
        return per_ctx * sum_ctx + per_request * batch

    # Times for the simulator: seconds, with pipeline stages.

    def prefill_stage_s(self, sum_len: float, sum_sq: float, cached: float = 0.0) -> float:
        """How long a stage is busy with a prompt batch: the next batch may start after this.
        A pipeline measured as it runs says its own share of the latency (`prefill_stage`:
        its slowest stage, with the hand-offs); otherwise `pp` even stages (a chunked step
        too)."""
        measured = self.coefficients.prefill_stage if self.rounds else 0.0
        return self.prefill_ms(sum_len, sum_sq, cached) * (measured or 1 / self.pp) / 1e3

    def prefill_latency_s(self, sum_len: float, sum_sq: float, cached: float = 0.0) -> float:
        overhead = 0.0 if self.rounds else self.stage_overhead_ms * (self.pp - 1)
        return (self.prefill_ms(sum_len, sum_sq, cached) + overhead) / 1e3

    def decode_step_s(self, batch: int, sum_ctx: float) -> float:
        """One token for every running request; `pp` micro-batches keep all stages busy (a
        measured round is the round's time already)."""
        return self.decode_ms(batch, sum_ctx) / (1 if self.rounds else self.pp) / 1e3
