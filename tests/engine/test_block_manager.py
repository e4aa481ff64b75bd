import random
import sys
import threading

import pytest

from shared.engine.block_manager import BlockManager, blocks_for, chain_hashes


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


# -- prefix caching ------------------------------------------------------------------------

def test_chain_hashes_name_a_block_by_every_token_up_to_its_end() -> None:
    a = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(a) == 2  # full blocks only
    assert chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4) == a  # extended, the same
    assert chain_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 4, a[:1])[:2] == a
    b = chain_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert b[0] != a[0] and b[1] != a[1]  # the same second block after another first
    assert chain_hashes([1, 2, 3, 4, 5, 6, 7, 9], 4)[0] == a[0]
    assert chain_hashes([1, 2, 3, 4, 5, 6, 7, 9], 4)[1] != a[1]
    assert len(set(chain_hashes(list(range(4000)), 4))) == 1000


def test_a_registered_block_is_shared_then_cached_free_then_taken_last() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    hashes = chain_hashes(list(range(8)), 4)
    first = bm.allocate(3)
    assert first is not None
    bm.register(first[0], hashes[0])
    bm.register(first[1], hashes[1])
    assert bm.cached_run(hashes) == (2, 0)  # both held: taking them frees nothing
    shared = bm.take_cached(hashes)
    assert shared == first[:2]
    bm.free(first)  # the first holder leaves: the second still holds two of them
    assert bm.num_free == 2 and bm.num_cached == 0
    bm.free(shared)
    assert bm.num_free == 4 and bm.num_cached == 2
    assert bm.cached_run(hashes) == (2, 2)
    other = bm.allocate(2)  # the blocks holding nothing go first
    assert other is not None and not set(other) & set(first[:2])
    assert bm.cached_run(hashes) == (2, 2)
    last = bm.allocate(1)  # then a cached one, the prefix's last block first
    assert last == [first[1]] and bm.num_cached == 1
    assert bm.cached_run(hashes) == (1, 1)  # its prefix is forgotten
    assert bm.take_cached(hashes) == [first[0]] and bm.num_free == 0
    with pytest.raises(AssertionError):
        bm.register(99, hashes[1])  # not held


def test_a_table_for_imported_kv_starts_with_the_blocks_the_pool_holds_of_its_prefix() -> None:
    """A decode instance's table for a request whose KV it pulls: the cached blocks of its
    leading run (however many `hashes` name) then fresh ones; a table that does not fit
    takes nothing, counting the cached blocks it would revive as taken."""
    bm = BlockManager(num_blocks=6, block_size=4)
    hashes = chain_hashes(list(range(16)), 4)
    held = bm.allocate(3)
    assert held is not None
    for block, digest in zip(held, hashes, strict=False):
        bm.register(block, digest)
    bm.free(held[1:])  # two of the three cached and free, the first still held
    other = bm.allocate(1)
    assert other is not None
    assert bm.allocate_after(hashes, 6) is None  # 3 fresh + 2 revived > 4 free
    assert bm.num_free == 4 and bm.num_cached == 2
    bm.free(other)
    found = bm.allocate_after([hashes[0], hashes[1], hashes[3]], 4)  # the run stops at 2
    assert found is not None
    table, run = found
    assert run == 2 and table[:2] == held[:2] and not set(table[2:]) & set(held)
    assert bm.num_free == 2 and bm.num_cached == 1  # the third block's prefix still kept
    assert bm.allocate_after(hashes, 1) == ([held[0]], 1)  # never more than the table
    bm.free(table)
    assert bm.allocate_after([], 2) is not None


def test_a_prefix_held_by_one_block_stays_that_blocks() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    digest = chain_hashes([1, 2, 3, 4], 4)[0]
    a, b = bm.allocate(1), bm.allocate(1)
    assert a is not None and b is not None
    bm.register(a[0], digest)
    bm.register(b[0], digest)  # computed twice at once: the first keeps the name
    bm.free(a + b)
    assert bm.num_cached == 1 and bm.take_cached([digest]) == a


def test_a_salt_keeps_prompts_apart() -> None:
    tokens = list(range(12))
    plain, salted = chain_hashes(tokens, 4), chain_hashes(tokens, 4, salt="tenant-a")
    assert not set(plain) & set(salted)
    assert chain_hashes(tokens, 4, salt="tenant-a") == salted
    assert not set(chain_hashes(tokens, 4, salt="tenant-b")) & set(salted)
    # a salt spelling another chain's hash names no block of that chain
    assert chain_hashes(tokens[4:8], 4, salt=plain[0].decode("latin-1"))[0] != plain[1]
