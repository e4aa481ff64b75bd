"""What a benchmark run measured, and the figures made from it (pure: no I/O, no clock).

Times are seconds from the start of the run. A request that failed or timed out stays in
every total and never attains an objective."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from shared.metrics import SLO, attainment, goodput_from_curve, percentiles, tpot
from shared.state import StepSample

# The stages of a disaggregated request, in order (the paper's Fig. 10), as the services
# name their spans.
STAGES = ("prefill queue", "prefill run", "kv transfer", "decode queue", "decode run")


@dataclass
class RequestRecord:
    index: int
    arrival_s: float  # when it was due to be sent
    prompt_tokens: int
    max_tokens: int
    sent_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    tokens: int = 0
    error: str | None = None
    request_id: str | None = None
    cached_tokens: int = 0  # of the prompt, found in a prefix cache (its usage says)

    @property
    def ok(self) -> bool:
        return self.error is None and self.first_token_s is not None

    @property
    def ttft(self) -> float | None:
        if not self.ok or self.sent_s is None or self.first_token_s is None:
            return None
        return self.first_token_s - self.sent_s

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.first_token_s is None or self.last_token_s is None:
            return None
        return tpot(self.first_token_s, self.last_token_s, self.tokens)

    @property
    def latency(self) -> float | None:
        if not self.ok or self.sent_s is None or self.last_token_s is None:
            return None
        return self.last_token_s - self.sent_s

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ttft_s": self.ttft, "tpot_s": self.tpot,
                "latency_s": self.latency}


@dataclass
class RunResult:
    """One rate's requests."""

    rate: float
    records: list[RequestRecord]
    duration_s: float
    breakdown_s: dict[str, float] = field(default_factory=dict)
    # the engine steps the stack's workers ran meanwhile, by instance (distserve.bench.steps)
    steps: dict[str, list[StepSample]] = field(default_factory=dict)

    @property
    def failed(self) -> int:
        return sum(not r.ok for r in self.records)

    def attainment(self, slo: SLO) -> float:
        return attainment([r.ttft for r in self.records], [r.tpot for r in self.records], slo)

    def summary(self, slo: SLO, target: float) -> dict[str, Any]:
        done = [r for r in self.records if r.ok]
        tokens = sum(r.tokens for r in done)
        return {
            "cached_share": cached_share(done),
            "rate": self.rate,
            "requests": len(self.records),
            "completed": len(done),
            "failed": self.failed,
            "errors": sorted({r.error for r in self.records if r.error}),
            "attainment": self.attainment(slo),
            "ttft_attainment": _share(r.ttft is not None and r.ttft <= slo.ttft_s
                                      for r in self.records),
            "tpot_attainment": _share(r.tpot is not None and r.tpot <= slo.tpot_s
                                      for r in self.records),
            "ttft_s": percentiles([r.ttft for r in done if r.ttft is not None]),
            "tpot_s": percentiles([r.tpot for r in done if r.tpot is not None]),
            "latency_s": percentiles([r.latency for r in done if r.latency is not None]),
            "throughput_rps": len(done) / self.duration_s if self.duration_s > 0 else 0.0,
            "output_tokens_per_s": tokens / self.duration_s if self.duration_s > 0 else 0.0,
            "tightest_slo_scale": tightest_slo_scale(self.records, slo, target),
            "breakdown_s": self.breakdown_s,
        }


def cached_share(records: Sequence[RequestRecord]) -> float:
    """Of the prompt tokens of `records`, the share their prefix caches held."""
    prompts = sum(r.prompt_tokens for r in records)
    return sum(r.cached_tokens for r in records) / prompts if prompts else 0.0


def _share(flags: Iterable[bool]) -> float:
    values = list(flags)
    return sum(values) / len(values) if values else 0.0


def slo_scale_needed(record: RequestRecord, slo: SLO) -> float:
    """The smallest scale s at which `record` meets s x SLO (inf if it failed)."""
    if record.ttft is None or record.tpot is None:
        return math.inf
    return max(record.ttft / slo.ttft_s, record.tpot / slo.tpot_s)


def attainment_at_scales(records: Sequence[RequestRecord], slo: SLO,
                         scales: Sequence[float]) -> list[float]:
    needed = [slo_scale_needed(r, slo) for r in records]
    return [_share(n <= s for n in needed) for s in scales]


def tightest_slo_scale(records: Sequence[RequestRecord], slo: SLO, target: float) -> float:
    """The smallest scale s at which a `target` share of all requests meets s x SLO: the
    ceil(target x n)-th smallest per-request scale (inf when too many failed)."""
    if not records:
        return math.inf
    needed = sorted(slo_scale_needed(r, slo) for r in records)
    k = max(1, math.ceil(target * len(needed) - 1e-9))
    return needed[k - 1]


def goodput(runs: Sequence[RunResult], slo: SLO, target: float) -> float:
    return goodput_from_curve([r.rate for r in runs], [r.attainment(slo) for r in runs], target)


def met_everywhere(runs: Sequence[RunResult], slo: SLO, target: float) -> bool:
    """Every rate run met the target: the goodput is the highest rate run, a lower bound."""
    return bool(runs) and all(r.attainment(slo) >= target for r in runs)


def stage_breakdown(spans: Iterable[dict[str, Any]], request_ids: set[str]) -> dict[str, float]:
    """Mean seconds per stage over the requests in `request_ids`, from the services' spans
    (OpenTelemetry JSON): a request's spans share the trace of its gateway "request" span."""
    spans = list(spans)
    traces = traces_of(spans, request_ids)
    totals: dict[str, list[float]] = {stage: [] for stage in STAGES}
    for s in spans:
        if s["name"] in totals and s["context"]["trace_id"] in traces:
            totals[s["name"]].append(span_seconds(s))
    return {stage: sum(v) / len(v) for stage, v in totals.items() if v}


def spanned_id(response_id: str) -> str:
    """The request id the services' spans carry for a completion's response id (cmpl-<id>)."""
    return response_id.split("-", 1)[-1]


def traces_of(spans: Sequence[dict[str, Any]], request_ids: Iterable[str]) -> set[str]:
    """The traces of the requests in `request_ids` (their gateway "request" spans')."""
    wanted = set(request_ids)
    return {s["context"]["trace_id"] for s in spans
            if s["name"] == "request" and s["attributes"].get("request_id") in wanted}


def handoff_s(spans: Iterable[dict[str, Any]], request_ids: Iterable[str]) -> float | None:
    """The median over `request_ids` of the KV handoff their spans time: from the end of the
    prefill run (the first token) to the start of the decode run (the KV pulled and imported,
    the request handed to the decode engine), so the announcement, the decode queue and the
    transfer; None where no request has both spans (a colocated stack times neither)."""
    spans = list(spans)
    traces = traces_of(spans, request_ids)
    runs: dict[str, dict[str, tuple[float, float]]] = {}
    for s in spans:
        if s["name"] in ("prefill run", "decode run") and s["context"]["trace_id"] in traces:
            runs.setdefault(s["context"]["trace_id"], {})[s["name"]] = span_bounds(s)
    found = [both["decode run"][0] - both["prefill run"][1] for both in runs.values()
             if len(both) == 2]
    return statistics.median(found) if found else None


def span_bounds(span: dict[str, Any]) -> tuple[float, float]:
    """A span's start and end, epoch seconds."""
    def parse(stamp: str) -> float:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()

    return parse(span["start_time"]), parse(span["end_time"])


def span_seconds(span: dict[str, Any]) -> float:
    start, end = span_bounds(span)
    return end - start
