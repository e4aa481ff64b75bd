"""Each rank's part of the model's weights, cut as they are read (where each rank sits and
which layers and heads it holds: shared/engine/parallel/layout.py). Within a stage,
Megatron's split of a Llama layer: Q/K/V and gate/up by output rows (each rank computes its
own query and KV heads and its own slice of the MLP), the output and down projections by
input columns (each rank's partial sums are added by one all-reduce after each). Norms are
whole on every rank of their stage, the embedding on the first stage, the final norm on the
last; the LM head only on rank 0, which samples."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from shared.engine.config import ModelConfig
from shared.engine.parallel.layout import check_tp
from shared.engine.quant import BLOCK, QuantizedMatrix

Tensor = torch.Tensor | QuantizedMatrix


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
