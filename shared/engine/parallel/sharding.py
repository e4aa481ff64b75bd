"""Which part of the model each rank of an instance holds (pure).

Ranks form a grid of `pp` pipeline stages of `tp` ranks each (rank = stage * tp + tp rank).
A stage holds a contiguous run of layers (the first stages one more where `pp` does not
divide them). Within a stage, Megatron's split of a Llama layer: Q/K/V and gate/up by output
rows (each rank computes its own query and KV heads and its own slice of the MLP), the output
and down projections by input columns (each rank's partial sums are added by one all-reduce
after each). Norms are whole on every rank of their stage, the embedding on the first stage,
the final norm on the last; the LM head only on rank 0, which samples."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from shared.engine.config import ModelConfig
from shared.engine.quant import BLOCK, QuantizedMatrix

Tensor = torch.Tensor | QuantizedMatrix


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
            if width % BLOCK:
                raise ValueError(f"quantized weights at tp {tp}: a rank's {what} columns "
                                 f"({width}) are not whole blocks of {BLOCK}")


def shard_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The shape one of `tp` ranks computes: its share of the heads and MLP columns."""
    check_tp(config, tp)
    return dataclasses.replace(config, num_heads=config.num_heads // tp,
                               num_kv_heads=config.num_kv_heads // tp,
                               intermediate_size=config.intermediate_size // tp)


def _split(config: ModelConfig, tp: int) -> dict[str, tuple[int, int]]:
    """Weight name (its last part) -> (dimension split, width of one rank's part)."""
    q, kv, mlp = config.q_size // tp, config.kv_size // tp, config.intermediate_size // tp
    return {"q_proj": (0, q), "k_proj": (0, kv), "v_proj": (0, kv),
            "q_bias": (0, q), "k_bias": (0, kv), "v_bias": (0, kv),
            "gate_proj": (0, mlp), "up_proj": (0, mlp),
            "o_proj": (1, q), "down_proj": (1, mlp)}


def narrow(tensor: Tensor, dim: int, start: int, width: int) -> Tensor:
    """`width` rows (dim 0) or input columns (dim 1) of an (out, in) weight from `start`."""
    if isinstance(tensor, torch.Tensor):
        return tensor.narrow(dim, start, width)
    if dim == 0:
        return tensor.rows(torch.arange(start, start + width))
    assert start % BLOCK == 0 and width % BLOCK == 0, "checked by check_tp"
    per_block = BLOCK * tensor.bits // 8
    blocks = slice(start // BLOCK, (start + width) // BLOCK)
    return QuantizedMatrix(
        tensor.bits,
        tensor.qweight[:, blocks.start * per_block:blocks.stop * per_block].contiguous(),
        tensor.scales[:, blocks].contiguous(),
        None if tensor.mins is None else tensor.mins[:, blocks].contiguous())


class ShardedWeights(Mapping[str, Tensor]):
    """Rank `rank`'s part of each weight of `weights` (by the engine's names), cut as it is
    read, so a lazy mapping over a checkpoint is still read one tensor at a time."""

    def __init__(self, weights: Mapping[str, Tensor], config: ModelConfig, rank: int,
                 tp: int) -> None:
        check_tp(config, tp)
        self.weights, self.rank = weights, rank
        self.split = _split(config, tp)

    def __getitem__(self, name: str) -> Tensor:
        tensor = self.weights[name]
        how = self.split.get(name.rsplit(".", 1)[-1])
        if how is None:
            return tensor
        dim, width = how
        return narrow(tensor, dim, self.rank * width, width)

    def __iter__(self) -> Iterator[str]:
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)
