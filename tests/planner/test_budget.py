"""Online planning on a device budget, and which instances a scale-down drains (pure)."""

import numpy as np
import pytest

from services.planner.budget import ONE, Option, Shape, Split, plan_within_budget, split
from services.planner.deployer import kind_of, to_drain
from services.planner.modes import role_of
from services.planner.placement import Problem
from services.planner.profiles import load_profile, shipped_cpu_profile
from shared.metrics import SLO
from shared.state import InstanceInfo
from shared.workloads import Lengths, Workload


def counts(budget: int, prefill_rps: float, decode_rps: float) -> tuple[int, int] | None:
    found = split(budget, [Option(ONE, prefill_rps)], [Option(ONE, decode_rps)])
    return None if found is None else (found.n_prefill, found.n_decode)


def chosen(found: Split | None) -> tuple[Shape, int, Shape, int]:
    assert found is not None
    return found.prefill.shape, found.n_prefill, found.decode.shape, found.n_decode


def test_split_balances_the_two_phases_goodput() -> None:
    assert counts(3, prefill_rps=10.0, decode_rps=5.0) == (1, 2)
    assert counts(3, prefill_rps=1.0, decode_rps=40.0) == (2, 1)
    assert counts(5, prefill_rps=2.0, decode_rps=3.0) == (3, 2)  # min(6, 6)
    assert counts(4, prefill_rps=1.0, decode_rps=1.0) == (2, 2)
    assert counts(2, prefill_rps=0.1, decode_rps=100.0) == (1, 1)  # one per phase at least
    assert counts(1, 1.0, 1.0) is None


def test_split_weighs_each_shape_by_the_devices_it_takes() -> None:
    tp2 = Shape(2)
    # a tp 2 prefill instance serving 3x one device's: worth its two devices
    assert chosen(split(4, [Option(ONE, 1.0), Option(tp2, 3.0)], [Option(ONE, 2.0)])) == (
        tp2, 1, ONE, 2)  # min(3, 4) beats min(2, 4)
    # ... serving only 1.5x: two one-device instances serve more on the same devices
    assert chosen(split(4, [Option(ONE, 1.0), Option(tp2, 1.5)], [Option(ONE, 2.0)])) == (
        ONE, 2, ONE, 2)
    # a shape wider than the budget leaves room for nothing else: never chosen
    assert chosen(split(3, [Option(Shape(4), 100.0), Option(ONE, 1.0)],
                        [Option(tp2, 10.0)])) == (ONE, 1, tp2, 1)
    assert split(2, [Option(tp2, 1.0)], [Option(ONE, 1.0)]) is None
    # a device left over where no instance of either shape fits
    assert chosen(split(5, [Option(tp2, 5.0)], [Option(tp2, 5.0)])) == (tp2, 1, tp2, 1)
    assert str(tp2) == "tp2" and str(Shape(2, 2)) == "tp2 pp2" and tp2.label("decode") == \
        "decode tp2" and ONE.label("decode") == "decode"


def problem(prompt: int, output: int) -> Problem:
    profile = load_profile(shipped_cpu_profile(1))
    lengths = Lengths(np.array([prompt] * 8), np.array([output] * 8))
    return Problem(profile, Workload(lengths), SLO(5.0, 0.25), 1.0, 1, 3, workers=1)


def test_longer_prompts_move_the_budget_toward_prefill() -> None:
    chat = plan_within_budget(problem(16, 24), 3)
    summarize = plan_within_budget(problem(384, 2), 3)
    assert chat is not None and summarize is not None
    assert (chat.prefill, chat.decode) == (1, 2)
    assert (summarize.prefill, summarize.decode) == (2, 1)
    assert summarize.prefill_goodput_rps < chat.prefill_goodput_rps / 5
    assert summarize.goodput_rps == pytest.approx(
        min(2 * summarize.prefill_goodput_rps, summarize.decode_goodput_rps))


def test_scale_down_drains_the_least_loaded_instances() -> None:
    live = [InstanceInfo(instance_id="d-a", role="decode", running=5),
            InstanceInfo(instance_id="d-b", role="decode", running=1),
            InstanceInfo(instance_id="d-c", role="decode", running=2, queue_len=3)]
    assert [i.instance_id for i in to_drain(live, 1)] == ["d-b", "d-a"]
    assert to_drain(live, 3) == [] and to_drain(live, 5) == []


def test_colocated_workers_are_counted_by_how_they_prefill() -> None:
    chunked = InstanceInfo(instance_id="c-a", role="colocated", chunked=True)
    plain = InstanceInfo(instance_id="c-b", role="colocated")
    assert [kind_of(i) for i in (chunked, plain)] == ["chunked", "colocated"]
    assert kind_of(InstanceInfo(instance_id="p", role="prefill", chunked=True)) == "prefill"
    assert [role_of(k) for k in ("chunked", "colocated", "decode")] == ["colocated",
                                                                       "colocated", "decode"]
