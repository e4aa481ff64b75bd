import pytest

from shared.engine.block_manager import BlockManager, blocks_for


def test_blocks_for_rounds_up() -> None:
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_until_exhausted_then_none_without_taking_anything() -> None:
    bm = BlockManager(num_blocks=5, block_size=4)
    first = bm.allocate(3)
    assert first is not None and len(set(first)) == 3
    assert bm.num_free == 2
    assert bm.allocate(3) is None  # cannot fit: nothing taken
    assert bm.num_free == 2
    second = bm.allocate(2)
    assert second is not None and not set(first) & set(second)
    assert bm.num_free == 0 and not bm.can_allocate(1)


def test_free_returns_blocks_and_rejects_double_free() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    ids = bm.allocate(4)
    assert ids is not None
    bm.free(ids)
    assert bm.num_free == 4
    with pytest.raises(AssertionError):
        bm.free(ids[:1])


def test_grow_extends_table_only_when_needed() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    table: list[int] = []
    assert bm.grow(table, 4) and len(table) == 1
    assert bm.grow(table, 4) and len(table) == 1  # still fits
    assert bm.grow(table, 9) and len(table) == 3
    assert not bm.grow(table, 13)  # a 4th block does not exist
    assert len(table) == 3 and bm.num_free == 0
