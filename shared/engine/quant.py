"""Weight-only quantized matrices for decoding on the CPU: blocks of 32 weights along the input
dimension, each with a scale (int8, GGUF's Q8_0) or a scale and a minimum (int4, GGUF's Q4_1;
Q4_0 is a minimum of -8 scales). Decode reads every weight once a step, so fewer bytes a
weight is a faster step; activations and the KV cache stay float32, so a full-precision
prefill instance hands its KV to a quantized decode instance unchanged.

A GGUF's own blocks are taken as they are (no re-quantising of dequantized floats); any other
weights are quantized here, per block, to the nearest level."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from shared.engine.config import QUANT_BLOCK
from shared.engine.kernels import cpu_kernels
from shared.engine.panels import PanelMatrix

BLOCK = QUANT_BLOCK  # weights a block
PANEL = 16  # output columns a panel of the kernel's layout
# GGUF block types the formats read directly: name -> (bits, bytes a block)
GGUF_BLOCKS = {"Q8_0": (8, 34), "Q4_0": (4, 18), "Q4_1": (4, 20)}
NO_MINS = torch.empty(0)  # int8 blocks have none


@dataclass(frozen=True)
class QuantizedMatrix:
    """An (out, in) matrix: `qweight` uint8 [out, in * bits / 8] (4 bits: byte j of a block
    holds weight j in its low nibble, j + 16 in its high one, as GGUF packs them), `scales`
    and (4 bits) `mins` float32 [out, in / 32]."""

    bits: int
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.scales.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return _nbytes(self.qweight, self.scales, self.mins)

    def dequantize(self) -> torch.Tensor:
        out, blocks = self.scales.shape
        w = _levels(self).float() * self.scales[..., None]
        if self.mins is not None:
            w = w + self.mins[..., None]
        return w.reshape(out, blocks * BLOCK)

    def rows(self, index: torch.Tensor) -> QuantizedMatrix:
        """The rows of `index`, in its order (blocks run along a row, so rows move whole)."""
        return QuantizedMatrix(self.bits, self.qweight[index].contiguous(),
                               self.scales[index].contiguous(),
                               None if self.mins is None else self.mins[index].contiguous())


@dataclass(frozen=True)
class QuantizedPanels:
    """A QuantizedMatrix laid out for the kernel (kernels/quantized_matmul.cpp): panels of
    PANEL output columns; within a panel, block by block, the levels of each input for the
    panel's columns side by side (int4: inputs k and k + 1 of a column in one byte, low and
    high nibble; int8: input k's 16 bytes, then k + 1's). `weights` uint8 [panels, blocks,
    32 * PANEL * bits / 8], `scales` and (4 bits) `mins` float32 [panels, blocks, PANEL]; the
    last panel's columns past `out_features` are zero."""

    bits: int
    out_features: int
    weights: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None

    @classmethod
    def pack(cls, m: QuantizedMatrix) -> QuantizedPanels:
        out = m.scales.shape[0]
        pad = -out % PANEL

        def panels(t: torch.Tensor) -> torch.Tensor:  # [out, blocks, ...] to
            # [panels, blocks, PANEL, ...]
            t = torch.cat((t, t.new_zeros(pad, *t.shape[1:]))) if pad else t
            return t.view(-1, PANEL, *t.shape[1:]).transpose(1, 2)

        levels = panels(_levels(m)).transpose(2, 3)  # [panels, blocks, 32 inputs, PANEL]
        if m.bits == 4:
            packed = levels[:, :, 0::2] | (levels[:, :, 1::2] << 4)
        else:
            packed = levels.view(torch.uint8)
        return cls(m.bits, out, packed.reshape(*packed.shape[:2], -1).contiguous(),
                   panels(m.scales).contiguous(),
                   None if m.mins is None else panels(m.mins).contiguous())

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.scales.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return _nbytes(self.weights, self.scales, self.mins)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T over x's last dimension."""
        kernels = cpu_kernels()
        assert kernels is not None, "quantized weights need the CPU kernels (checked at load)"
        mins = self.mins if self.mins is not None else NO_MINS
        out = kernels.quantized_matmul(x.reshape(-1, x.shape[-1]), self.weights, self.scales,
                                       mins, self.bits, self.out_features)
        return out.view(*x.shape[:-1], -1)  # type: ignore[no-any-return]

    def dequantize(self) -> torch.Tensor:
        panels, blocks, _ = self.weights.shape
        if self.bits == 4:
            pairs = self.weights.view(panels, blocks, BLOCK // 2, PANEL)
            levels = torch.stack((pairs & 15, pairs >> 4), dim=3).flatten(2, 3).float()
        else:
            levels = self.weights.view(torch.int8).view(panels, blocks, BLOCK, PANEL).float()
        w = levels * self.scales[:, :, None]
        if self.mins is not None:
            w = w + self.mins[:, :, None]
        # [panels, blocks, 32, PANEL] -> [panels * PANEL, blocks * 32]
        w = w.permute(0, 3, 1, 2).reshape(panels * PANEL, blocks * BLOCK)
        return w[: self.out_features]


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _levels(m: QuantizedMatrix) -> torch.Tensor:
    """Each weight's integer level, [out, blocks, 32] (int4: uint8 0..15; int8: int8)."""
    out, blocks = m.scales.shape
    q = m.qweight.view(out, blocks, -1)
    if m.bits == 4:
        return torch.cat((q & 15, q >> 4), dim=-1)
    return q.view(torch.int8)


def quantize(weight: torch.Tensor, bits: int) -> QuantizedMatrix:
    """Quantize an (out, in) float matrix block by block to the nearest level."""
    out, width = weight.shape
    if width % BLOCK:
        raise ValueError(f"{bits}-bit weights need input sizes divisible by {BLOCK}, not {width}")
    w = weight.detach().to("cpu", torch.float32).reshape(out, width // BLOCK, BLOCK)
    if bits == 8:
        scales = w.abs().amax(-1) / 127
        q = (w / scales.clamp_min(1e-30)[..., None]).round().clamp(-127, 127).to(torch.int8)
        return QuantizedMatrix(8, q.view(torch.uint8).reshape(out, width).contiguous(),
                               scales.contiguous())
    low, high = w.amin(-1), w.amax(-1)
    scales = (high - low) / 15
    q = ((w - low[..., None]) / scales.clamp_min(1e-30)[..., None]).round().clamp(0, 15)
    q = q.to(torch.uint8)
    packed = q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)
    return QuantizedMatrix(4, packed.reshape(out, width // 2).contiguous(), scales.contiguous(),
                           low.contiguous())


def from_gguf_blocks(data: np.ndarray, kind: str) -> QuantizedMatrix:
    """A GGUF tensor of Q8_0, Q4_0 or Q4_1 blocks ([out, bytes a row] uint8), as stored."""
    _, size = GGUF_BLOCKS[kind]
    out = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(out, -1, size)
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        return QuantizedMatrix(8, torch.from_numpy(blocks[..., 2:].reshape(out, -1).copy()),
                               torch.from_numpy(scales))
    if kind == "Q4_1":
        mins = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        packed = blocks[..., 4:]
    else:  # Q4_0: w = d * (q - 8)
        mins = -8 * scales
        packed = blocks[..., 2:]
    return QuantizedMatrix(4, torch.from_numpy(packed.reshape(out, -1).copy()),
                           torch.from_numpy(scales), torch.from_numpy(mins))


def stack_rows(parts: Sequence[torch.Tensor | QuantizedMatrix], bits: int) -> QuantizedMatrix:
    """(out, in) parts stacked by rows into one `bits` matrix (Q, K, V into QKV). A part
    already quantized to `bits` is kept as it is; any other is quantized (a dequantized
    one first)."""
    quantized = [p if isinstance(p, QuantizedMatrix) and p.bits == bits else
                 quantize(p.dequantize() if isinstance(p, QuantizedMatrix) else p, bits)
                 for p in parts]
    if len(quantized) == 1:
        return quantized[0]
    mins = [q.mins for q in quantized if q.mins is not None]
    return QuantizedMatrix(bits, torch.cat([q.qweight for q in quantized]),
                           torch.cat([q.scales for q in quantized]),
                           torch.cat(mins) if mins else None)


def matmul(x: torch.Tensor, weight: torch.Tensor | PanelMatrix | QuantizedPanels) -> torch.Tensor:
    """x @ W for a float [in, out] matrix, x @ W^T for a packed or quantized (out, in) one."""
    if isinstance(weight, torch.Tensor):
        return x @ weight
    return weight.matmul(x)  # panels, float or quantized
