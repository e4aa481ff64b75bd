import pytest

from shared.metrics import SLO, attainment, attains, goodput_from_curve, tpot


def test_tpot_is_time_after_first_token_over_remaining_tokens() -> None:
    assert tpot(1.0, 2.0, 11) == pytest.approx(0.1)
    assert tpot(1.0, 1.0, 1) == 0.0


def test_attainment_is_joint_and_counts_failures() -> None:
    slo = SLO(ttft_s=1.0, tpot_s=0.1)
    assert attains(0.5, 0.05, slo) and not attains(1.5, 0.05, slo)
    assert not attains(0.5, 0.2, slo) and not attains(None, None, slo)
    # 4 requests: one meets both, one misses TTFT, one misses TPOT, one failed
    assert attainment([0.5, 2.0, 0.5, None], [0.05, 0.05, 0.5, None], slo) == 0.25


def test_goodput_interpolates_where_attainment_crosses_the_target() -> None:
    rates = [1.0, 2.0, 3.0, 4.0]
    assert goodput_from_curve(rates, [1.0, 0.95, 0.85, 0.5], 0.9) == pytest.approx(2.5)
    assert goodput_from_curve(rates, [0.8, 0.7, 0.6, 0.5], 0.9) == 0.0
    assert goodput_from_curve(rates, [1.0, 1.0, 1.0, 0.95], 0.9) == 4.0
    assert goodput_from_curve([3.0, 1.0], [0.8, 1.0], 0.9) == pytest.approx(2.0)  # unsorted


def test_slo_rejects_non_positive_objectives() -> None:
    with pytest.raises(ValueError):
        SLO(0.0, 1.0)
