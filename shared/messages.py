"""Messages between services, one model per channel, each with an explicit version."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from shared.engine.parallel.layout import KvSpan
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
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: list[tuple[int, float]] = Field(default_factory=list)
    grammar: str = ""  # the answer held to it (shared/engine/structured.py)
    cache_salt: str = ""  # cached prefixes shared only with requests of the same salt

    def params(self) -> SamplingParams:
        return SamplingParams(self.max_tokens, self.temperature, self.top_p, self.top_k,
                              self.seed, tuple(self.stop), self.ignore_eos, self.logprobs,
                              self.top_logprobs, self.prompt_logprobs, self.presence_penalty,
                              self.frequency_penalty, tuple(self.logit_bias), self.grammar,
                              self.cache_salt)


class PrefillRequest(BaseModel):
    """gateway -> ds.prefill.<instance> (or a colocated worker). A request that failed over
    with tokens already streamed comes back with them in `output_ids`: they are prefilled
    with the prompt and the next token is sampled at its own output index, so the text goes
    on exactly as it would have."""

    version: Literal[2] = 2  # 2: output_ids, attempt (then gateway, defaulted: still 2)
    request_id: str
    prompt_ids: list[int]
    sampling: Sampling
    decode_instance: str = ""  # empty for a colocated worker
    arrival_ts: float
    output_ids: list[int] = Field(default_factory=list)
    attempt: int = 0  # how many times the gateway has moved the request
    # the gateway that sent it (its lease, subjects.gateway_key): a worker cancels the
    # request once that gateway is gone; "": not said (a gateway before it), never
    gateway: str = ""


class Resume(BaseModel):
    """gateway -> ds.resume.<prefill instance> (a NATS request): announce the request's KV,
    if still held, to another decode instance, which replays `output_ids` on top of it.
    The reply is a ResumeReply."""

    version: Literal[1] = 1
    request_id: str
    decode_instance: str
    output_ids: list[int]
    attempt: int


class ResumeReply(BaseModel):
    version: Literal[1] = 1
    held: bool  # False: the KV is gone; the gateway prefills the request again elsewhere


class KvSource(BaseModel):
    """A rank of a prefill instance that serves its part of a request's KV (its layers, its
    KV heads, the model's numbering; ends exclusive)."""

    address: str  # its UCX listener, host:port
    layers: tuple[int, int]
    kv_heads: tuple[int, int]

    @classmethod
    def of(cls, address: str, span: KvSpan) -> KvSource:
        return cls(address=address, layers=(span.layers.start, span.layers.stop),
                   kv_heads=(span.heads.start, span.heads.stop))

    def span(self) -> KvSpan:
        return KvSpan(range(*self.layers), range(*self.kv_heads))


class KvReady(BaseModel):
    """prefill -> ds.decode.<instance>: a request's KV waits to be pulled, from each rank of
    the prefill instance the part it holds (one source: a one-rank instance, all of it)."""

    version: Literal[4] = 4  # 2: the pull token; 3: output_ids, computed, attempt; 4: sources
    request_id: str
    prefill_instance: str
    sources: list[KvSource]  # the prefill instance's ranks, rank 0 first
    token: str  # the pull's credential (any rank's): sent to this decode instance only
    num_blocks: int
    prompt_ids: list[int]
    output_ids: list[int]  # the tokens sampled so far: the first one, or more after a move
    last_logprob: float | None = None  # of output_ids[-1], when logprobs were asked for
    computed: int  # leading tokens whose KV the blocks hold; the rest are replayed
    sampling: Sampling
    arrival_ts: float
    first_token_ts: float
    attempt: int = 0
    kv_dtype: str = ""  # the blocks' dtype ("float32"); "": not said (a sender before it)
    gateway: str = ""  # PrefillRequest.gateway, so the decode instance watches its lease too
    # the prefill instance serves a pull's "skip" (leaves out the leading blocks the decode
    # instance holds): False from a sender before it, which sends every block
    skips: bool = False


class ReleaseKv(BaseModel):
    """decode -> ds.release.<prefill instance>: the KV was imported (or the pull given up);
    the prefill instance keeps it a short retention more, for a failover."""

    version: Literal[1] = 1
    request_id: str
    attempt: int = 0  # a release for an attempt the request has moved on from is ignored


class KvWanted(BaseModel):
    """prefill -> ds.wanted.<decode instance> (a NATS request): these requests' KV has
    waited here a lease's time without a release; which does the decode instance still mean
    to pull (announced to it, queued or being pulled)? The reply is a KvWantedReply; the
    prefill instance frees the rest (their announcement, release or cancel was lost)."""

    version: Literal[1] = 1
    prefill_instance: str
    attempts: dict[str, int]  # request id -> the attempt announced


class KvWantedReply(BaseModel):
    version: Literal[1] = 1
    wanted: list[str]


class Cancel(BaseModel):
    """gateway -> ds.cancel.<request>: the client went away, or (with `instance`) the
    request moved away from that one instance."""

    version: Literal[1] = 1
    request_id: str
    instance: str = ""  # only this instance drops it; empty: every instance
    attempt: int | None = None  # with `instance`: the attempts up to this one are stale there


class TokenChunk(BaseModel):
    """prefill or decode -> ds.tokens.<request>: new tokens and text, then the end. `seq` is
    the output index of the chunk's first token (for a chunk without tokens: how many the
    sender had produced), so the gateway sees a chunk that NATS lost as a gap."""

    version: Literal[2] = 2  # 2: seq, attempt, retry
    request_id: str
    seq: int = 0
    attempt: int = 0  # the gateway's attempt this chunk belongs to: older ones are stale
    retry: bool = False  # with `error`: this instance cannot go on, but the request can
    token_ids: list[int] = Field(default_factory=list)
    text: str = ""
    logprobs: list[float] = Field(default_factory=list)
    # each token's most likely alternatives (token id, logprob), where asked for
    top_logprobs: list[list[tuple[int, float]]] = Field(default_factory=list)
    # with the first token (a long prompt's in several chunks just before it), where asked
    # for: prompt token p + 1's logprob given tokens 0..p, p from prompt_from on, and the
    # likeliest there
    prompt_from: int = 0
    prompt_logprobs: list[float] = Field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = Field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "abort"
    error: str | None = None
    # with `error`: the request asked what cannot be served (it can never fit here, its
    # format outgrew the limits): the client's 400, not a server's failure
    refused: bool = False
    cached_tokens: int = 0  # with the first token: the prompt's tokens found in the KV pool
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
    cached_tokens: int = 0  # of the prompt, found in a prefix cache (not computed)


class WorkloadSummary(BaseModel):
    """Recent history: what a plan is made for."""

    rate_rps: float
    arrival_cv: float
    prompt_tokens: list[int]  # the window's lengths, paired request by request
    output_tokens: list[int]
    # the tokens of each prompt found in a prefix cache, paired too (empty: not known, as
    # from a sender before it: every prompt computed whole)
    cached_tokens: list[int] = []


class ReplanRequest(BaseModel):
    """profiler (or `distserve plan --live --replan`) -> ds.planner.replan."""

    version: Literal[1] = 1
    reasons: list[str]
    workload: WorkloadSummary | None = None  # None: the planner uses the last one it saw


class Drain(BaseModel):
    """planner -> ds.drain.<instance>: leave dispatch, finish what you hold, exit."""

    version: Literal[1] = 1
    reason: str = ""


class StartWorker(BaseModel):
    """planner -> ds.launcher.start (a NATS request): start a worker of `kind` with `tp`
    ranks and `pp` stages (0: as `distserve up` set its role's). The reply is a
    StartedWorker."""

    version: Literal[1] = 1
    kind: Literal["prefill", "decode", "colocated", "chunked"]
    tp: int = Field(default=0, ge=0, le=64)
    pp: int = Field(default=0, ge=0, le=64)


class StartedWorker(BaseModel):
    version: Literal[1] = 1
    instance: str = ""  # its name, which is its first instance id
    error: str = ""  # why none was started


class Workers(BaseModel):
    """planner -> ds.launcher.exited, .starting or .stop (NATS requests), of workers the
    launcher started for it: which of these have exited (crashed, whether restarted since or
    not), which run as first started (none asked), or stop these. The reply is a Workers
    too: the exited ones, the running ones, or those stopped."""

    version: Literal[1] = 1
    instances: list[str] = []
