"""Where each rank of an instance sits, and which layers and KV heads it holds (pure, no
torch: the planner, the gateway's messages and the KV protocol use it without loading the
engine). Ranks form a grid of `pp` pipeline stages of `tp` ranks each (rank = stage * tp +
tp rank); a stage holds a contiguous run of layers (the first stages one more where `pp`
does not divide them), and within a stage each rank its share of the query and KV heads and
of the MLP's columns (shared/engine/parallel/sharding.py splits the weights so)."""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

from shared.engine.config import QUANT_BLOCK, ModelConfig


@dataclass(frozen=True)
class RankPlace:
    """Where a rank sits in its instance's grid of `pp` stages x `tp` ranks."""

    rank: int = 0
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.tp * self.pp

    @property
    def stage(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.pp - 1

    def layers(self, num_layers: int) -> range:
        """The layers of this rank's stage."""
        return stage_layers(num_layers, self.pp)[self.stage]

    def kv_heads(self, num_kv_heads: int) -> range:
        """The KV heads this rank holds."""
        share = num_kv_heads // self.tp
        return range(self.tp_rank * share, (self.tp_rank + 1) * share)

    @property
    def source(self) -> int | None:
        """The rank whose hidden states this rank's stage takes (None: it embeds tokens)."""
        return None if self.first else self.rank - self.tp

    @property
    def target(self) -> int | None:
        """The rank this rank hands its hidden states to: its peer in the next stage; from the
        last stage, rank 0 (which samples), by the stage's first rank."""
        if not self.last:
            return self.rank + self.tp
        return 0 if self.tp_rank == 0 and self.pp > 1 else None


@dataclass(frozen=True)
class KvSpan:
    """A part of a model's KV cache: a run of its layers and a run of its KV heads (the
    model's numbering). A rank holds one; a transfer moves the overlap of two."""

    layers: range
    heads: range

    @classmethod
    def of(cls, place: RankPlace, config: ModelConfig) -> KvSpan:
        """The KV that rank `place` holds."""
        return cls(place.layers(config.num_layers), place.kv_heads(config.num_kv_heads))

    @classmethod
    def whole(cls, config: ModelConfig) -> KvSpan:
        return cls(range(config.num_layers), range(config.num_kv_heads))

    def overlap(self, other: KvSpan) -> KvSpan | None:
        layers = range(max(self.layers.start, other.layers.start),
                       min(self.layers.stop, other.layers.stop))
        heads = range(max(self.heads.start, other.heads.start),
                      min(self.heads.stop, other.heads.stop))
        return KvSpan(layers, heads) if layers and heads else None

    def within(self, outer: KvSpan) -> tuple[slice, slice]:
        """Where this span lies in a buffer of `outer`'s layers and heads: the slices of its
        layer and head dimensions."""
        assert self.overlap(outer) == self, f"{self} is not within {outer}"
        return (slice(self.layers.start - outer.layers.start,
                      self.layers.stop - outer.layers.start),
                slice(self.heads.start - outer.heads.start,
                      self.heads.stop - outer.heads.start))


def kv_pieces(wanted: KvSpan, held: list[KvSpan]) -> list[tuple[int, KvSpan]]:
    """What to pull from whom to fill `wanted` from ranks holding `held` (an instance's
    ranks: disjoint spans that cover the model): (index into `held`, the part it gives), each
    part of the KV once. ValueError if they leave some of `wanted` uncovered."""
    pieces = [(i, part) for i, span in enumerate(held)
              if (part := span.overlap(wanted)) is not None]
    covered = sum(len(p.layers) * len(p.heads) for _, p in pieces)
    overlapping = any(a.overlap(b) is not None
                      for (_, a), (_, b) in itertools.combinations(pieces, 2))
    if overlapping or covered != len(wanted.layers) * len(wanted.heads):
        raise ValueError(f"the ranks' KV ({held}) does not cover {wanted} once")
    return pieces


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """Contiguous layers of each of `pp` stages, the first ones a layer more if need be."""
    if not 1 <= pp <= num_layers:
        raise ValueError(f"pp {pp} needs between 1 and the model's {num_layers} layers")
    size, extra = divmod(num_layers, pp)
    starts = [stage * size + min(stage, extra) for stage in range(pp + 1)]
    return [range(a, b) for a, b in itertools.pairwise(starts)]


def check_tp(config: ModelConfig, tp: int, quantized: bool = False) -> None:
    """ValueError unless `tp` ranks can split `config` evenly (and, for quantized weights,
    at the quantization blocks)."""
    if tp < 1:
        raise ValueError(f"tensor parallelism needs at least 1 rank, not {tp}")
    for what, count in (("KV heads", config.num_kv_heads), ("query heads", config.num_heads),
                        ("MLP columns", config.intermediate_size)):
        if count % tp:
            raise ValueError(f"{config.name} has {count} {what}: tp {tp} does not divide them")
    if quantized:
        for what, width in (("query", config.q_size // tp),
                            ("MLP", config.intermediate_size // tp)):
            if width % QUANT_BLOCK:
                raise ValueError(f"quantized weights at tp {tp}: a rank's {what} columns "
                                 f"({width}) are not whole blocks of {QUANT_BLOCK}")


def shard_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The shape one of `tp` ranks computes: its share of the heads and MLP columns."""
    check_tp(config, tp)
    return dataclasses.replace(config, num_heads=config.num_heads // tp,
                               num_kv_heads=config.num_kv_heads // tp,
                               intermediate_size=config.intermediate_size // tp)


def kv_block_bytes(config: ModelConfig, tp: int, pp: int, block_size: int,
                   element_bytes: int) -> int:
    """Bytes of one KV block on a rank of an instance of `tp` ranks by `pp` stages: its share
    of the KV heads over the widest stage's layers (every rank of an instance holds as many
    blocks, so that rank 0's block ids hold everywhere)."""
    layers = max(len(stage) for stage in stage_layers(config.num_layers, pp))
    shard = dataclasses.replace(shard_config(config, tp) if tp > 1 else config,
                                num_layers=layers)
    return block_size * shard.kv_bytes_per_token(element_bytes)


def kv_budget_problem(budget_bytes: int, block_bytes: int, block_size: int,
                      model: str) -> str | None:
    """Why a rank's KV budget of `budget_bytes` cannot serve `model` (blocks of `block_size`
    tokens, `block_bytes` each), None if it can: it holds no block. A user's mistake (too
    small a --kv-cache-mb), said with the smallest budget that holds one."""
    if budget_bytes >= block_bytes:
        return None
    mib = 1 << 20
    return (f"a KV cache of {budget_bytes / mib:g} MiB holds no block of {model} (a block of "
            f"{block_size} tokens takes {block_bytes / mib:.3g} MiB a rank): give "
            f"--kv-cache-mb {math.ceil(block_bytes / mib)} or more")
