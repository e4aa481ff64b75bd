"""The gateway's Prometheus figures: requests by outcome, TTFT and TPOT (from each request's
one RequestTiming), and from its view the instances' KV pools (gauges) and their KV transfer
and engine-loop totals (counters)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from services.gateway.timing import RequestTiming
from services.gateway.view import stuck_for
from shared.state import InstanceInfo

# InstanceInfo field -> (metric name, help)
INSTANCE_GAUGES = {
    "free_blocks": ("ds_kv_free_blocks", "free KV blocks"),
    "total_blocks": ("ds_kv_total_blocks", "KV blocks in the pool"),
    "cached_blocks": ("ds_kv_cached_blocks", "of the free KV blocks, those holding a prefix "
                      "a request may reuse (taken as the pool needs them)"),
}
# an instance's running totals, exported as counters (`<name>_total`); a new incarnation
# counts from 0 again, which Prometheus's rate() takes as a counter reset
INSTANCE_TOTALS = {
    "kv_bytes": ("ds_kv_transfer_bytes", "KV bytes moved over UCX"),
    "kv_requests": ("ds_kv_transfer_requests", "KV transfers over UCX"),
    "steps": ("ds_engine_steps", "engine steps"),
    "step_seconds": ("ds_engine_step_seconds", "seconds in engine steps"),
    "step_cpu_seconds": ("ds_engine_step_cpu_seconds",
                         "of the seconds in engine steps, the engine thread's on a CPU"),
    "step_queued_seconds": ("ds_engine_step_queued_seconds", "of the seconds in engine "
                            "steps, the engine thread's runnable but waiting for a CPU"),
    "outputs_seconds": ("ds_engine_outputs_seconds", "seconds handling step outputs"),
    "batched": ("ds_engine_batched_requests", "requests that got a token, summed over steps"),
    "prefix_queried": ("ds_prefix_cache_queried_tokens", "tokens of the requests admitted "
                       "that looked for their prefix in the KV pool"),
    "prefix_hits": ("ds_prefix_cache_hit_tokens", "of those, the tokens found there (not "
                    "computed; on a decode instance: whose KV was not pulled)"),
}


class InstanceTotals(Collector):
    """The live instances' totals as of their last heartbeats, as counters: read when
    /metrics is served, so an instance that stopped heartbeating leaves them."""

    def __init__(self) -> None:
        self.live: list[InstanceInfo] = []

    def collect(self) -> Iterator[CounterMetricFamily]:
        live = self.live  # one list for every family (`instances` swaps in a new one)
        for field, (name, text) in INSTANCE_TOTALS.items():
            family = CounterMetricFamily(name, text, labels=["instance", "role"])
            for info in live:
                family.add_metric([info.instance_id, info.role], getattr(info, field))
            yield family


def outcome_label(outcome: str) -> str:
    """A bounded label for the counter: the outcome itself may be an error message."""
    return {"stop": "ok", "length": "ok", "cancelled": "cancelled",
            "refused": "rejected"}.get(outcome, "error")  # refused: the request's own doing


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("ds_requests", "requests by outcome", ["outcome"],
                                registry=self.registry)
        self.ttft = Histogram("ds_ttft_seconds", "time to first token", registry=self.registry)
        self.tpot = Histogram("ds_tpot_seconds", "time per output token after the first",
                              registry=self.registry,
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5))
        self.moves = Counter("ds_request_moves", "requests moved to other instances, by cause "
                             "(decode_died, prefill_died, worker_died, stalled, stuck, gap, "
                             "kv_transfer) and path (kv_held: the prefill instance still held "
                             "the KV; re_prefill: prefilled again)", ["cause", "path"],
                             registry=self.registry)
        self.inflight = Gauge("ds_gateway_inflight", "requests admitted and not yet answered",
                              registry=self.registry)
        self.gauges = {field: Gauge(name, text, ["instance", "role"], registry=self.registry)
                       for field, (name, text) in INSTANCE_GAUGES.items()}
        self.totals = InstanceTotals()
        self.registry.register(self.totals)
        self.stuck = Gauge("ds_engine_stuck_seconds", "how long the engine has been at the "
                           "step or call under way, as of its last heartbeat (0: idle); past "
                           "DS_STUCK_AFTER_S it gets no requests while others serve",
                           ["instance", "role"], registry=self.registry)

    def observe(self, timing: RequestTiming, outcome: str) -> None:
        self.requests.labels(outcome_label(outcome)).inc()
        if timing.ttft_s is not None:
            self.ttft.observe(timing.ttft_s)
        if timing.tpot_s is not None:
            self.tpot.observe(timing.tpot_s)

    def rejected(self, status: int) -> None:
        self.requests.labels("overloaded" if status == 429 else
                             "rejected" if status < 500 else "error").inc()

    def instances(self, live: Iterable[InstanceInfo]) -> None:
        self.totals.live = live = list(live)
        for gauge in [*self.gauges.values(), self.stuck]:
            gauge.clear()  # instances that stopped heartbeating leave the figures
        for info in live:
            for field, gauge in self.gauges.items():
                gauge.labels(info.instance_id, info.role).set(getattr(info, field))
            self.stuck.labels(info.instance_id, info.role).set(stuck_for(info))
