"""Reading the gateway's /metrics (Prometheus text) in benchmarks and tests, through
prometheus_client's parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample named `name` (a counter's with its `_total`), with its labels."""
    return [(s.labels, float(s.value)) for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name]
