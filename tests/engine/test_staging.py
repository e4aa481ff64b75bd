"""The buffers KV transfers stage blocks in: taken, given back once a transfer is done with
them, and lent again to the next (pure, milliseconds)."""

import torch

from shared.engine.config import LLAMA_SHAPES
from shared.engine.kv_cache import MIB, KVCache, Staging


def test_a_buffer_given_back_is_lent_again_and_one_never_given_back_is_not() -> None:
    staging = Staging(keep=2)
    first = staging.take((4, 1000), torch.float32)
    assert first.shape == (4, 1000) and first.is_contiguous() and staging.fresh == 1
    staging.give(first)
    second = staging.take((2, 500), torch.bfloat16)  # smaller, another dtype: the same room
    assert second.data_ptr() == first.data_ptr() and staging.fresh == 1
    third = staging.take((8,), torch.float32)  # the one buffer is lent: a new one
    assert third.data_ptr() != second.data_ptr() and staging.fresh == 2
    staging.give(second)
    staging.give(second)  # twice: kept once
    assert staging.idle_bytes == MIB
    big = staging.take((MIB,), torch.float32)  # 4 MiB: nothing idle holds it
    assert staging.fresh == 3 and staging.idle_bytes == MIB
    for lent in (big, third):
        staging.give(lent)
    assert staging.idle_bytes == 4 * MIB + MIB  # the two largest kept, the smallest dropped
    small = staging.take((10,), torch.float32)  # the smallest that holds it
    assert small.untyped_storage().nbytes() == MIB


def test_blocks_exported_into_a_staging_buffer_are_the_blocks() -> None:
    kv = KVCache(LLAMA_SHAPES["tiny"], 16, 4, torch.float32, torch.device("cpu"))
    kv.data.copy_(torch.randn(kv.data.shape, generator=torch.Generator().manual_seed(3)))
    staging = Staging()
    for blocks in ([5, 2, 9], [1, 2], [15, 0, 3, 7]):
        staged = kv.export_blocks(blocks, alloc=staging.take)
        assert torch.equal(staged, kv.export_blocks(blocks))
        part = kv.export_blocks(blocks, slice(1, 2), slice(0, 1), staging.take)
        assert torch.equal(part, kv.export_blocks(blocks, slice(1, 2), slice(0, 1)))
        staging.give(staged)
        staging.give(part)
    assert staging.fresh == 2  # the first round's two buffers served every later one


def test_idle_buffers_are_held_to_their_byte_limit() -> None:
    """Idle buffers past `max_idle_bytes` together are let go, the largest first: one long
    transfer does not keep its memory held for good."""
    staging = Staging(keep=2, max_idle_bytes=3 * MIB)
    small, large = staging.take((MIB // 4,), torch.float32), staging.take((2 * MIB,),
                                                                          torch.uint8)
    staging.give(small)
    staging.give(large)
    assert staging.idle_bytes == 3 * MIB  # 1 + 2 MiB: within the limit
    huge = staging.take((4 * MIB,), torch.uint8)
    staging.give(huge)  # over the limit by itself
    assert staging.idle_bytes == 3 * MIB
    middle = staging.take((MIB + 1,), torch.uint8)  # the 2 MiB one
    assert middle.untyped_storage().nbytes() == 2 * MIB
    staging.give(middle)
    staging.give(staging.take((MIB,), torch.uint8))  # the 1 MiB one, back again
    assert staging.idle_bytes == 3 * MIB


def test_buffers_laid_ready_serve_the_first_transfers() -> None:
    """`warm` lays `keep` buffers ready, every page touched, so the first transfers of up to
    their size take no fresh one; within `max_idle_bytes` together."""
    staging = Staging(keep=2, max_idle_bytes=16 * MIB)
    assert staging.warm(3 * MIB + 1) == 2 * 4 * MIB  # rounded up to a MiB, `keep` of them
    first, second = (staging.take((3 * MIB,), torch.uint8) for _ in range(2))
    assert staging.fresh == 0 and first.data_ptr() != second.data_ptr()
    assert staging.take((MIB,), torch.uint8) is not None and staging.fresh == 1  # both lent
    staging.give(first)
    staging.give(second)
    # of two alike, the one given back last (its pages the likelier still cached)
    assert staging.take((MIB,), torch.uint8).data_ptr() == second.data_ptr()
    alike = Staging(keep=2)
    a, b, c = (alike.take((MIB,), torch.uint8) for _ in range(3))
    for lent in (a, b, c):
        alike.give(lent)
    # past `keep`, the oldest of one size goes; the newest is lent first
    assert alike.idle_bytes == 2 * MIB
    assert [alike.take((MIB,), torch.uint8).data_ptr() for _ in range(2)] == \
        [c.data_ptr(), b.data_ptr()]
    capped = Staging(keep=2, max_idle_bytes=6 * MIB)
    assert capped.warm(100 * MIB) == 2 * 3 * MIB and capped.idle_bytes == 6 * MIB
    assert Staging(keep=2, max_idle_bytes=MIB).warm(MIB) == 0  # under a MiB each: none


def test_a_pools_staging_is_laid_ready_for_a_prompt_of_the_tokens_given() -> None:
    kv = KVCache(LLAMA_SHAPES["tiny"], 4096, 16, torch.float32, torch.device("cpu"))  # 32 MiB
    per_block = kv.data.nbytes // kv.num_blocks
    staging = Staging.for_pool(kv, warm_tokens=16 * 40 + 1)  # 41 blocks
    assert staging is not None and staging.keep == 2
    size = -(-41 * per_block // MIB) * MIB
    assert staging.idle_bytes == 2 * min(size, kv.data.nbytes // 4 // 2 // MIB * MIB)
    ready = staging.take(kv.export_blocks(list(range(41))).shape, torch.float32)
    assert staging.fresh == 0 and ready.numel() * 4 == 41 * per_block
    cold = Staging.for_pool(kv)
    assert cold is not None and cold.idle_bytes == 0
