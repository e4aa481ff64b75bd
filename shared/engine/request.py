"""A request owns its progress: token ids, how many have K/V in the pool, its block table."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from shared.engine.structured import Guide


class RequestStatus(enum.IntEnum):
    WAITING = 0  # queued for (re)prefill
    RUNNING = 1  # prefilling in chunks or decoding
    PARKED = 2  # prefill role: prefilled, holding its blocks until a decode instance pulls them
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


MAX_TOP_LOGPROBS = 20  # OpenAI's bound

# the most likely tokens at a position, with their logprobs, most likely first
TopLogprobs = tuple[tuple[int, float], ...]


class Draw(NamedTuple):
    """A request's sampled token, its logprob and the top ones, where asked for."""

    token: int
    logprob: float | None = None
    top: TopLogprobs = ()


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int = 0  # draws depend only on (seed, output index): reproducible anywhere
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # with logprobs: the most likely tokens' at each position
    prompt_logprobs: bool = False  # each prompt token's given those before it (and the top)
    # OpenAI's: a token's logit lowered by presence (once it was generated) + frequency x
    # the times it was; logit_bias added to the logits of the tokens it names
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # the grammar the answer is held to (structured.py: a JSON schema's), "" for none
    grammar: str = ""
    # prefix caching: a prompt shares cached blocks only with prompts of the same salt
    cache_salt: str = ""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if any(not stop for stop in self.stop):
            raise ValueError("a stop string must not be empty")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if any(not -100 <= bias <= 100 for _, bias in self.logit_bias):
            raise ValueError("a logit_bias must be in [-100, 100]")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got "
                             f"{self.top_logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def adjusts(self) -> bool:
        """Whether the logits are changed before sampling (penalties, a bias)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_ids: frozenset[int] = frozenset()  # ids that end the generation
    arrival: int = 0  # order of arrival; the newest running request is preempted first
    output_ids: list[int] = field(default_factory=list)
    tag: int = 0  # the caller's label for this copy, carried by its outputs (an attempt)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[TopLogprobs] = field(default_factory=list)
    # with params.prompt_logprobs: prompt token p + 1 scored given tokens 0..p, p from 0 on
    prompt_scores: list[Draw] = field(default_factory=list)
    num_computed: int = 0  # leading tokens whose K/V are in the pool
    block_table: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    in_step: bool = False  # scheduled in a step not yet updated (a micro-batch under way)
    # prefix caching: the prompt tokens found in the pool when it was last admitted, the
    # hashes of its full blocks so far, and how many of its blocks are registered
    cached_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered: int = 0
    guide: Guide | None = None  # with params.grammar: where the answer is in it (the engine's)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("the prompt is empty")

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_span(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) without building the whole prompt + output list (a decode
        step needs only the newest token)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n:end - n]
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[:end - n]

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def check(self, block_size: int) -> None:
        assert 0 <= self.num_computed <= self.num_tokens, (self.num_computed, self.num_tokens)
        assert self.num_computed <= len(self.block_table) * block_size

    def append(self, token: int, logprob: float | None, top: TopLogprobs = ()) -> None:
        """Record a sampled token and finish on EOS or max_tokens (stop strings are text and
        are checked by the engine's output processor)."""
        self.output_ids.append(token)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if self.params.top_logprobs:
            self.output_top.append(top)
        if token in self.eos_ids and not self.params.ignore_eos:
            self.status = RequestStatus.FINISHED_STOPPED
        elif len(self.output_ids) >= self.params.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
