"""Prefix affinity, pure: where a prompt's start went."""

from __future__ import annotations

from services.gateway.affinity import PrefixAffinity


def test_the_longest_start_recorded_names_the_instance() -> None:
    affinity = PrefixAffinity(block_size=4)
    system = list(range(100, 112))  # three blocks
    first = affinity.hashes([*system, 1, 2, 3, 4, 5])
    assert len(first) == 4 and affinity.holder(first) == ""
    affinity.record(first, "p0")
    affinity.record(affinity.hashes([*system[:4], 9, 9, 9, 9, 9]), "p1")  # one block shared
    assert affinity.holder(affinity.hashes([*system, 7, 7, 7, 7, 7])) == "p0"  # three blocks
    assert affinity.holder(affinity.hashes([*system[:4], 9, 9, 9, 9, 1])) == "p1"
    assert affinity.holder(affinity.hashes([*system[:4], 8, 8, 8, 8, 1])) == "p1"
    assert affinity.holder(affinity.hashes([5, 5, 5, 5, 5])) == ""
    # the block holding a prompt's last token is computed wherever it goes: not a hint
    assert affinity.hashes([1, 2, 3, 4]) == affinity.hashes([1, 2, 3])


def test_the_least_recently_sent_prefixes_are_forgotten_first() -> None:
    affinity = PrefixAffinity(block_size=2, most=4)
    a, b, c = (affinity.hashes([n, n, n, n, 0]) for n in (1, 2, 3))
    affinity.record(a, "p0")
    affinity.record(b, "p1")
    affinity.record(a, "p0")  # sent again: the most recent
    affinity.record(c, "p2")
    assert affinity.holder(a) == "p0" and affinity.holder(c) == "p2"
    assert affinity.holder(b) == ""


def test_each_instance_a_start_went_to_may_hold_its_longest_run() -> None:
    """A block remembers the last few instances it went to: a prompt's holder is the last
    one its longest run went to, and each instance may hold its own longest run."""
    affinity = PrefixAffinity(block_size=4)
    system = list(range(100, 108))  # two blocks
    affinity.record(affinity.hashes([*system, 1, 1, 1, 1, 0]), "c0")  # three blocks
    affinity.record(affinity.hashes([*system, 2, 2, 2, 2, 0]), "c1")
    affinity.record(affinity.hashes([*system, 1, 1, 1, 1, 5, 5, 5, 5, 0]), "c2")
    turn = affinity.hashes([*system, 1, 1, 1, 1, 5, 5, 5, 5, 6, 6, 6, 6, 0])
    assert affinity.found(turn) == ("c2", {"c2": 4, "c0": 3, "c1": 2})
    assert affinity.found(affinity.hashes([*system, 3, 3, 3, 3, 0])) == \
        ("c2", {"c2": 2, "c1": 2, "c0": 2})  # the last the system prompt went to
    assert affinity.found(affinity.hashes([9, 9, 9, 9, 9])) == ("", {})
    for n in range(5):  # past HOLDERS (4) instances, the least recent is forgotten
        affinity.record(affinity.hashes([*system, 0]), f"x{n}")
    assert set(affinity.found(affinity.hashes([*system, 0]))[1]) == {"x1", "x2", "x3", "x4"}
