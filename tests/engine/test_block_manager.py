import random
import sys
import threading

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


@pytest.mark.timeout(60)
def test_two_threads_taking_and_freeing_blocks_never_share_one() -> None:
    """A CPU decode service takes a pull's blocks on its event loop while the engine thread
    takes and frees blocks for its steps: every `allocate` and `free` is atomic, so no block
    is handed out twice, none is lost and no call fails on a pool another emptied under it.
    Threads are switched every microsecond to make an interleaving likely."""
    pool = BlockManager(num_blocks=24, block_size=16)
    errors: list[BaseException] = []
    held: list[set[int]] = [set(), set()]

    def churn(me: int, seed: int) -> None:
        rng = random.Random(seed)
        tables: list[list[int]] = []
        try:
            for _ in range(20_000):
                if tables and (rng.random() < 0.5 or pool.num_free == 0):
                    table = tables.pop(rng.randrange(len(tables)))
                    held[me].difference_update(table)
                    pool.free(table)
                elif (taken := pool.allocate(rng.randint(1, 4))) is not None:
                    assert not held[1 - me] & set(taken), "a block handed out twice"
                    held[me].update(taken)
                    tables.append(taken)
            for table in tables:
                held[me].difference_update(table)
                pool.free(table)
        except BaseException as e:
            errors.append(e)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=churn, args=(i, i)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    assert pool.num_free == pool.num_blocks and pool.allocate(24) is not None
