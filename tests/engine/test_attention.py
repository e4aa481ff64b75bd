"""The C++ paged decode kernel and the torch gather path compute the same attention, and
both equal plain attention over each request's contiguous context."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.engine.attention import DecodeGroup, gather_decode_attention, paged_decode_attention
from shared.engine.config import LLAMA_SHAPES
from shared.engine.kernels import cpu_kernels
from shared.engine.kv_cache import KVCache

CFG = LLAMA_SHAPES["tiny"]


def setup(dtype: torch.dtype) -> tuple[KVCache, DecodeGroup, torch.Tensor]:
    torch.manual_seed(0)
    kv = KVCache(CFG, 40, 4, dtype, torch.device("cpu"))
    kv.data.copy_(torch.randn(kv.data.shape))
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 0, 0], [9, 8, 11, 12]])
    lens = torch.tensor([10, 5, 16])
    mask = (torch.arange(16)[None] < lens[:, None])[:, None, None, :]
    q = torch.randn(3, CFG.num_heads, CFG.head_dim).to(dtype)
    return kv, DecodeGroup(0, tables, lens, mask), q


def reference(kv: KVCache, group: DecodeGroup, q: torch.Tensor, layer: int) -> torch.Tensor:
    rows = []
    for b, length in enumerate(group.context_lens.tolist()):
        slots = [int(group.block_tables[b, t // 4]) * 4 + t % 4 for t in range(length)]
        k = kv.slots[layer][0][slots].float().transpose(0, 1)  # [H_kv, L, D]
        v = kv.slots[layer][1][slots].float().transpose(0, 1)
        o = F.scaled_dot_product_attention(q[b].float().unsqueeze(1), k, v, enable_gqa=True)
        rows.append(o.reshape(-1))
    return torch.stack(rows)


def test_gather_path_matches_contiguous_attention() -> None:
    kv, group, q = setup(torch.float32)
    expected = reference(kv, group, q, layer=1)
    torch.testing.assert_close(gather_decode_attention(1, q, group, kv), expected)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_paged_kernel_matches_contiguous_attention(dtype: torch.dtype, tol: float) -> None:
    assert cpu_kernels() is not None, "the C++ kernel must build where gcc is installed"
    kv, group, q = setup(dtype)
    expected = reference(kv, group, q, layer=1)
    got = paged_decode_attention(1, q, group, kv).float()
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
