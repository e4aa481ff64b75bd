"""Messages between services, one model per channel, each with an explicit version."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from shared.engine.request import SamplingParams


class Sampling(BaseModel):
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: list[str] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False

    def params(self) -> SamplingParams:
        return SamplingParams(self.max_tokens, self.temperature, self.top_p, self.top_k,
                              self.seed, tuple(self.stop), self.ignore_eos, self.logprobs)


class PrefillRequest(BaseModel):
    """gateway -> ds.prefill.<instance> (or a colocated worker)."""

    version: Literal[1] = 1
    request_id: str
    prompt_ids: list[int]
    sampling: Sampling
    decode_instance: str = ""  # empty for a colocated worker
    arrival_ts: float


class KvReady(BaseModel):
    """prefill -> ds.decode.<instance>: a request's KV waits to be pulled."""

    version: Literal[2] = 2  # 2: the pull token
    request_id: str
    prefill_instance: str
    kv_address: str  # UCX listener, host:port
    token: str  # the pull's credential: sent to this decode instance only, never logged
    num_blocks: int
    prompt_ids: list[int]
    first_token: int
    first_logprob: float | None = None
    sampling: Sampling
    arrival_ts: float
    first_token_ts: float


class ReleaseKv(BaseModel):
    """decode -> ds.release.<prefill instance>: the pull landed (or was given up)."""

    version: Literal[1] = 1
    request_id: str


class Cancel(BaseModel):
    """gateway -> ds.cancel.<request>: the client went away."""

    version: Literal[1] = 1
    request_id: str


class TokenChunk(BaseModel):
    """prefill or decode -> ds.tokens.<request>: new tokens and text, then the end."""

    version: Literal[1] = 1
    request_id: str
    token_ids: list[int] = Field(default_factory=list)
    text: str = ""
    logprobs: list[float] = Field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "abort"
    error: str | None = None
    source: str = ""  # the instance that sent it


class RequestDone(BaseModel):
    """gateway -> ds.events.requests: a request left the system (the profiler's input)."""

    version: Literal[1] = 1
    arrival_ts: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None = None
    tpot_s: float | None = None
    outcome: str  # "stop", "length", an error, or "cancelled"


class WorkloadSummary(BaseModel):
    """Recent history: what a plan is made for."""

    rate_rps: float
    arrival_cv: float
    prompt_tokens: list[int]  # the window's lengths, paired request by request
    output_tokens: list[int]


class ReplanRequest(BaseModel):
    """profiler (or `distserve plan --live --replan`) -> ds.planner.replan."""

    version: Literal[1] = 1
    reasons: list[str]
    workload: WorkloadSummary | None = None  # None: the planner uses the last one it saw


class Drain(BaseModel):
    """planner -> ds.drain.<instance>: leave dispatch, finish what you hold, exit."""

    version: Literal[1] = 1
    reason: str = ""
