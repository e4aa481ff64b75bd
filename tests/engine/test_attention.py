"""The C++ paged decode kernel and the torch gather path compute the same attention, and
both equal plain attention over each request's contiguous context; the kernel's chunks of a
long context merge to the same attention, chunks past a short one's end left out."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from shared.engine import model as model_module
from shared.engine.attention import (
    DecodeGroup,
    PrefillSegment,
    gather_decode_attention,
    paged_decode_attention,
)
from shared.engine.config import LLAMA_SHAPES
from shared.engine.kernels import cpu_kernels
from shared.engine.kv_cache import KVCache
from shared.engine.model import LlamaModel

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
        size = kv.block_size
        slots = [int(group.block_tables[b, t // size]) * size + t % size
                 for t in range(length)]
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


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_chunks_of_long_and_short_contexts_merge_to_the_same_attention(threads: int) -> None:
    """Contexts of 300, 5 and 130 tokens split into chunks of 100 (at 2 threads): the short
    requests' later chunks are empty; one thread (chunks of 300) and four (of 64) too."""
    torch.manual_seed(threads)
    lens = torch.tensor([300, 5, 130])
    blocks = torch.randperm(200)
    tables = torch.zeros(3, 75, dtype=torch.long)
    start = 0
    for b, length in enumerate(lens.tolist()):
        n = -(-length // 4)
        tables[b, :n] = blocks[start:start + n]
        start += n
    kv = KVCache(CFG, 200, 4, torch.float32, torch.device("cpu"))
    kv.data.copy_(torch.randn(kv.data.shape) * 3)  # peaked scores: the rescaling matters
    check_at(threads, kv, tables, lens, layer=0, heads=CFG.num_heads)


def check_at(threads: int, kv: KVCache, tables: torch.Tensor, lens: torch.Tensor,
             layer: int, heads: int) -> None:
    """The kernel at `threads` threads equals plain attention, for `heads` random queries a
    request."""
    mask = (torch.arange(tables.shape[1] * kv.block_size)[None] < lens[:, None])[:, None, None]
    group = DecodeGroup(0, tables, lens, mask)
    q = torch.randn(len(lens), heads, kv.data.shape[-1])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = paged_decode_attention(layer, q, group, kv)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, reference(kv, group, q, layer), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
@pytest.mark.parametrize("threads", [1, 2])
def test_every_head_size_reads_a_scattered_pool_in_chunks_that_start_mid_block(
        head_dim: int, threads: int) -> None:
    """Head sizes the kernel runs with the size fixed (2-16 vectors) and those it does not,
    a group of 3 query heads a KV head, blocks of 16 scattered over the pool (the next block
    read ahead), contexts whose chunks start mid-block (600 tokens: chunks of 300 at one
    thread, 200 at two)."""
    torch.manual_seed(head_dim + threads)
    config = dataclasses.replace(CFG, num_heads=6, num_kv_heads=2, head_dim=head_dim)
    block, lens = 16, torch.tensor([600, 37, 250])
    per = -(-600 // block)
    kv = KVCache(config, 3 * per + 1, block, torch.float32, torch.device("cpu"))
    kv.data.copy_(torch.randn(kv.data.shape) * 2)
    tables = torch.randperm(3 * per + 1)[: 3 * per].view(3, per)
    check_at(threads, kv, tables, lens, layer=1, heads=config.num_heads)


def test_a_long_chunk_over_cached_context_attends_in_tiles_as_in_one_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt chunk after a cached prefix (a prefix cache's hit) attends in tiles of
    QUERY_TILE rows, each over the keys its rows reach: the same attention as plain causal
    attention over the whole context, tile by tile or in one call."""
    torch.manual_seed(0)
    model = LlamaModel.random(CFG, 0, torch.device("cpu"), torch.float32)
    kv = KVCache(CFG, 32, 4, torch.float32, torch.device("cpu"))
    kv.data.copy_(torch.randn(kv.data.shape))
    cached, length = 10, 37  # the chunk starts mid-block
    table = torch.randperm(32)[: -(-(cached + length) // 4)]
    slots = [int(table[t // 4]) * 4 + t % 4 for t in range(cached + length)]
    q = torch.randn(length, CFG.num_heads, CFG.head_dim)
    k, v = kv.slots[0][0][slots[cached:]], kv.slots[0][1][slots[cached:]]  # [n, H_kv, D]
    seg = PrefillSegment(0, length, cached, table)
    keys = kv.slots[0][0][slots].transpose(0, 1)  # [H_kv, cached + length, D]
    values = kv.slots[0][1][slots].transpose(0, 1)
    mask = torch.arange(cached + length)[None] <= torch.arange(length)[:, None] + cached
    qh = q.transpose(0, 1)
    expected = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask,
                                              enable_gqa=True).transpose(0, 1).reshape(length, -1)
    for tile in (8, 512):
        monkeypatch.setattr(model_module, "QUERY_TILE", tile)
        got = model._prefill_attention(0, q, k, v, seg, kv)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
