"""Float32 matrices packed in panels for the CPU's float matmul (kernels/float_matmul.cpp):
BLAS's skinny GEMMs, a decode step's, read the weights at half the memory bandwidth or less
on some CPUs (MKL on AMD EPYC), and a decode step is bound by reading them once.

A panel holds P of the matrix's rows (output columns) interleaved along its input, so it
streams from memory in one pass into a register tile of the output. The packed matrix is the
only copy the model keeps: a tied embedding reads its rows from the LM head's panels."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.engine.kernels import cpu_kernels


@dataclass(frozen=True)
class PanelMatrix:
    """An (out, in) float32 matrix as panels [ceil(out / P), in, P], the columns past `out`
    zero."""

    panels: torch.Tensor
    out_features: int

    @classmethod
    def pack(cls, *parts: torch.Tensor, width: int | None = None) -> PanelMatrix:
        """(out, in) parts stacked by rows (Q, K, V into QKV), each copied (and cast) once
        into its panels' columns: no concatenated or padded copy of the whole on the way.
        `width`: the panel width of another build than the engine's (a tuning variant's)."""
        if width is None:
            kernels = cpu_kernels()
            assert kernels is not None, "panels need the CPU kernels (checked by packable)"
            width = int(kernels.panel_width())
        inputs = parts[0].shape[1]
        rows = sum(part.shape[0] for part in parts)
        panels = torch.zeros(-(-rows // width), inputs, width, dtype=torch.float32)
        row = 0
        for part in parts:
            done = 0
            while done < part.shape[0]:  # the part's rows that fall in one panel at a time
                panel, column = divmod(row, width)
                take = min(width - column, part.shape[0] - done)
                panels[panel, :, column:column + take].copy_(part[done:done + take].t())
                done, row = done + take, row + take
        return cls(panels, rows)

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.panels.shape[1]

    @property
    def nbytes(self) -> int:
        return self.panels.numel() * self.panels.element_size()

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """The matrix's rows at `index` ([*index.shape, in]): an embedding's lookup."""
        width = self.panels.shape[2]
        return self.panels[index // width, :, index % width]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T over x's last dimension."""
        kernels = cpu_kernels()
        assert kernels is not None
        out = kernels.float_matmul(x.reshape(-1, x.shape[-1]), self.panels, self.out_features)
        return out.view(*x.shape[:-1], self.out_features)  # type: ignore[no-any-return]


def packable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether float weights on `device` in `dtype` run on the panel kernel."""
    return device.type == "cpu" and dtype == torch.float32 and cpu_kernels() is not None
