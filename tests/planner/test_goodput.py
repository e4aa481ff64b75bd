"""The goodput search (max_rate) on attainment curves given as functions: pure, milliseconds."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from services.planner.goodput import max_rate


def counted(threshold: float) -> tuple[list[float], Callable[[float], float]]:
    """A step curve that attains everything up to `threshold` req/s and nothing above it,
    recording the rates asked."""
    asked: list[float] = []

    def attainment_at(rate: float) -> float:
        asked.append(rate)
        return 1.0 if rate <= threshold else 0.0
    return asked, attainment_at


@pytest.mark.parametrize("threshold", [1e-4, 0.05, 0.37, 3.0, 11.5, 40.0])
def test_the_search_lands_within_its_tolerance_below_the_threshold(threshold: float) -> None:
    # 1e-4 and 0.05: far below the guess, the lowest rate is tried, attains, and the search
    # goes on up from it
    _, at = counted(threshold)
    found = max_rate(at, 0.9, guess=5.0)
    assert threshold * 0.98 <= found <= threshold


def test_a_config_that_misses_at_every_rate_is_found_out_in_a_few_simulations() -> None:
    asked, at = counted(0.0)  # not even a lone request attains
    assert max_rate(at, 0.9, guess=5.0) == 0.0
    # the guess, halvings until below a sixteenth of it, then the lowest rate: not 20 more
    assert len(asked) <= 7 and min(asked) == pytest.approx(5.0 / 2**20)


def test_a_throughput_bound_below_the_threshold_is_the_answer() -> None:
    _, at = counted(10.0)
    assert max_rate(at, 0.9, guess=2.0, upper=6.0) == 6.0


def test_a_low_throughput_bound_is_where_the_floor_check_starts_from() -> None:
    """A bound far below the guess (decode's, with a prefill-based guess): the rates under
    it are bisected before the lowest rate is tried."""
    asked, at = counted(0.02)
    found = max_rate(at, 0.9, guess=100.0, upper=0.5)
    assert 0.02 * 0.98 <= found <= 0.02
    assert asked[1] == 0.25  # halved from the bound, not the lowest rate at once
