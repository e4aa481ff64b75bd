"""OpenTelemetry tracing: one trace per request across services, its context carried in NATS
message headers (W3C traceparent). Spans go over OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is
set, otherwise as JSON lines to <run dir>/traces-<service>.jsonl."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Span, Tracer


class JsonLinesExporter(SpanExporter):
    """One span per line: what `jq` or a notebook reads without a trace backend."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a")
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            for span in spans:
                self._file.write(json.dumps(json.loads(span.to_json())) + "\n")
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self._file.close()


def setup_tracing(service: str, run_dir: str | None) -> Tracer:
    provider = TracerProvider(resource=Resource.create({"service.name": f"distserve-{service}"}))
    exporter: SpanExporter | None = None
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    elif run_dir:
        exporter = JsonLinesExporter(Path(run_dir) / f"traces-{service}.jsonl")
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    trace.set_tracer_provider(provider)
    return trace.get_tracer(f"distserve.{service}")


def headers_for(span: Span) -> dict[str, str]:
    """NATS headers carrying `span`'s context to the next service."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def context_from(headers: Mapping[str, str] | None) -> Context:
    return propagate.extract(dict(headers or {}))


def record(tracer: Tracer, name: str, parent: Context, start_s: float, end_s: float,
           **attributes: str | int | float) -> None:
    """A finished span with explicit wall-clock times (seconds)."""
    span = tracer.start_span(name, context=parent, start_time=int(start_s * 1e9),
                             attributes=attributes)
    span.end(end_time=int(max(end_s, start_s) * 1e9))


def shutdown() -> None:
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.shutdown()
