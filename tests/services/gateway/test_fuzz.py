"""The gateway's OpenAI routes fuzzed with Schemathesis: requests generated from its own
OpenAPI schema, valid and invalid ones, against a 1P+1D stack of real processes. No answer may
be a 5xx (nor a 200 stream that ends in an error event), every 4xx is an OpenAI-shaped error,
and afterwards the stack is as it was: healthy, the same instances, every KV block free."""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import Case, GenerationMode, Response

from services.launcher import Stack
from tests.services.conftest import metric
from tests.services.gateway.conftest import API_KEY

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
MODEL = "smollm2-135m"
OPERATIONS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
MODES = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
PER_RUN = 80  # cases per operation and mode: 3 x 2 x 80 = 480
MIN_CASES = 450
MIN_SERVED = 50  # so the fuzzing reaches the workers, not only the validation
SHORT = 4  # most tokens a fuzzed request generates (see `shortened`)
# reproducible (the seed comes from the test's code), no shrinking: a finding is recorded and
# the run goes on, so one run lists them all
FUZZ = settings(max_examples=PER_RUN, derandomize=True, database=None, deadline=None,
                phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))


@dataclass
class Finding:
    problem: str
    status: int
    body: Any
    answer: str

    def __str__(self) -> str:
        return f"{self.problem}: HTTP {self.status} for {json.dumps(self.body)[:400]} -> " \
               f"{self.answer[:300]}"


def shortened(body: Any, path: str) -> Any:
    """The body with an integer max_tokens / max_completion_tokens (a response's
    max_output_tokens) above SHORT lowered to SHORT (366.0 is an integer to JSON Schema and
    to the server), and max_tokens (max_output_tokens) SHORT when none is given (absent or
    null): a valid request stays valid, and 480 cases stay short on 2 cores. Only the length
    changes; "stream" and the rest go as generated. (Omitting max_tokens is tested in
    test_gateway.py.)"""
    if not isinstance(body, dict):
        return body
    out = dict(body)
    keys = ("max_output_tokens",) if path == "/v1/responses" else ("max_tokens",
                                                                   "max_completion_tokens")
    for key in keys:
        value = out.get(key)
        if (type(value) is int or (type(value) is float and value.is_integer())) \
                and value > SHORT:
            out[key] = SHORT
    if all(out.get(key) is None for key in keys):
        out[keys[0]] = SHORT
    return out


def error_message(response: Response) -> object:
    try:
        body = json.loads(response.content)
    except ValueError:
        return None
    return body.get("error", {}).get("message") if isinstance(body, dict) else None


def stream_problem(text: str, cut_short: bool, path: str) -> str | None:
    """What is wrong with a 200 event stream: an error event, or no [DONE] at its end (a
    response's stream: a failed response, or no completed or incomplete one at its end),
    unless the client stopped reading early."""
    events = [line.removeprefix("data: ") for line in text.splitlines()
              if line.startswith("data: ")]
    if path == "/v1/responses":
        kinds = [json.loads(e)["type"] for e in events]
        if "response.failed" in kinds or "error" in kinds:
            return "a failed response in a 200 stream"
        if not cut_short and kinds[-1:] not in (["response.completed"],
                                                 ["response.incomplete"]):
            return "a response stream that does not end completed or incomplete"
        return None
    if any(e.startswith("{") and "error" in json.loads(e) for e in events):
        return "error event in a 200 stream"
    if not cut_short and events[-1:] != ["[DONE]"]:
        return "stream without [DONE]"
    return None


def problem(response: Response, path: str) -> str | None:
    """What is wrong with an answer to `path`, or None."""
    status = response.status_code
    if status >= 500:
        return "server error"
    if status >= 400:
        return None if isinstance(error_message(response), str) else "4xx without error.message"
    if response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        return stream_problem(response.content.decode(errors="replace"),
                              response.stream_cut_short, path)
    if path == "/v1/responses":
        status = json.loads(response.content).get("status")
        return None if status in ("completed", "incomplete") else f"200 {status!r}"
    choices = json.loads(response.content).get("choices") or [{}]
    return None if choices[0].get("finish_reason") else "200 without a finish_reason"


def fuzz(url: str, schema: schemathesis.BaseSchema, path: str, mode: GenerationMode,
         findings: list[Finding]) -> Counter[int]:
    """Send PER_RUN generated requests to one operation; returns how many got each status.
    Valid bodies ask for the served model, so they reach the workers rather than stopping at
    that check, and for at most 2 choices (n up to 128 is valid; 320 cases stay short);
    invalid ones go as generated."""
    statuses: Counter[int] = Counter()

    @FUZZ
    @given(case=schema[path]["POST"].as_strategy(generation_mode=mode))
    def one(case: Case[Any]) -> None:
        if mode.is_positive and isinstance(case.body, dict):
            n = case.body.get("n")
            case.body = {**case.body, "model": MODEL,
                         "n": min(n, 2) if type(n) is int and n >= 1 else 1}
        case.body = shortened(case.body, path)
        try:
            response = case.call(base_url=url, timeout=120,
                                 headers={"Authorization": f"Bearer {API_KEY}"})
        except requests.RequestException as e:
            statuses[0] += 1
            findings.append(Finding(f"{mode} {path}: no answer", 0, case.body, repr(e)))
            return
        statuses[response.status_code] += 1
        if (why := problem(response, path)) is not None:
            findings.append(Finding(f"{mode} {path}: {why}", response.status_code, case.body,
                                    response.content.decode(errors="replace")))

    one()
    return statuses


def kv_free(url: str) -> bool:
    free, total = metric(url, "ds_kv_free_blocks"), metric(url, "ds_kv_total_blocks")
    return bool(total) and free == total


def test_generated_requests_get_no_server_error(secured: Stack) -> None:
    before = httpx.get(f"{secured.url}/health", timeout=10).json()
    schema = schemathesis.openapi.from_url(f"{secured.url}/openapi.json", timeout=60)
    findings: list[Finding] = []
    statuses = sum((fuzz(secured.url, schema, path, mode, findings)
                    for path in OPERATIONS for mode in MODES), Counter[int]())
    sent = statuses.total()
    report = "\n".join(str(f) for f in findings)
    print(f"statuses {dict(statuses)}\n{report}")  # shown by pytest when a check fails
    assert sent >= MIN_CASES
    assert statuses[200] >= MIN_SERVED, statuses
    after = httpx.get(f"{secured.url}/health", timeout=10).json()
    assert after["status"] == "ok" and after["instance_ids"] == before["instance_ids"]
    deadline = time.monotonic() + 60
    while not kv_free(secured.url) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert kv_free(secured.url), (metric(secured.url, "ds_kv_free_blocks"),
                                 metric(secured.url, "ds_kv_total_blocks"))
    assert not findings, f"{len(findings)} of {sent} cases failed:\n{report}"
