"""One request's timing, on one clock: it feeds the RequestDone event and Prometheus."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from shared.messages import RequestDone
from shared.metrics import tpot


@dataclass
class RequestTiming:
    prompt_tokens: int
    arrival_ts: float = field(default_factory=time.time)  # wall clock, for the event
    start: float = field(default_factory=time.monotonic)
    first_at: float | None = None
    last_at: float | None = None
    output_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, found in its prefill instance's KV pool

    def tokens(self, n: int, now: float | None = None) -> None:
        if n <= 0:
            return
        now = time.monotonic() if now is None else now
        self.first_at = self.first_at if self.first_at is not None else now
        self.last_at = now
        self.output_tokens += n

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_at is None else self.first_at - self.start

    @property
    def tpot_s(self) -> float | None:
        if self.first_at is None or self.last_at is None or self.output_tokens < 2:
            return None
        return tpot(self.first_at, self.last_at, self.output_tokens)

    def done(self, outcome: str) -> RequestDone:
        return RequestDone(arrival_ts=self.arrival_ts, prompt_tokens=self.prompt_tokens,
                           output_tokens=self.output_tokens, ttft_s=self.ttft_s,
                           tpot_s=self.tpot_s, outcome=outcome,
                           cached_tokens=self.cached_tokens)
