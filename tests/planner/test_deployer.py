"""The workers the planner's deployer starts run as `distserve up` started their role's:
the launcher hands the planner every role's weights, and the tp and pp given, and the
deployer gives a new worker its role's; the tp `up` left alone, the plan chooses."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest

from services.launcher import StackConfig
from services.planner.budget import ONE, Shape
from services.planner.deployer import (
    changes,
    fixed_shapes,
    live_shapes,
    ranks_of,
    role_env,
    unpriced_dtypes,
)
from services.planner.profiles import SHIPPED_PROFILES, load_profile, prefill_profile_or_none
from services.planner.service import PlannerSettings
from shared.state import InstanceInfo


def test_a_new_worker_gets_its_roles_weights_dtype_tp_and_pp_from_up() -> None:
    settings = StackConfig(decode_weights="int4", prefill_dtype="bfloat16", prefill_tp=3,
                           pp=2).role_settings()
    assert role_env(settings, "decode") == {"DS_WEIGHTS": "int4", "DS_DTYPE": "auto",
                                            "DS_TP": "1", "DS_PP": "2"}
    assert role_env(settings, "prefill") == {"DS_WEIGHTS": "auto", "DS_DTYPE": "bfloat16",
                                             "DS_TP": "3", "DS_PP": "2"}
    # colocated workers serve both phases: every worker's settings
    assert role_env(settings, "colocated") == {"DS_WEIGHTS": "auto", "DS_DTYPE": "auto",
                                               "DS_TP": "1", "DS_PP": "2"}
    assert ranks_of(role_env(settings, "prefill")) == 6


def test_roles_computing_in_another_dtype_than_the_profile_are_named() -> None:
    """The online planner prices every kind on one profile: the roles it then misprices
    (it warns) are those whose workers run another dtype than the profile's."""
    zen5 = SHIPPED_PROFILES / "smollm2-135m-cpu-1thread-amd-epyc-zen5"
    fp32, bf16 = load_profile(f"{zen5}.json"), load_profile(f"{zen5}-bfloat16.json")
    settings = StackConfig(prefill_dtype="bfloat16").role_settings()
    assert unpriced_dtypes(settings, fp32, on_gpu=False) == {"prefill": "bfloat16"}
    assert unpriced_dtypes(settings, bf16, on_gpu=False) == {"decode": "float32",
                                                             "colocated": "float32"}
    assert unpriced_dtypes(StackConfig().role_settings(), fp32, on_gpu=False) == {}
    # a prefill profile in the prefill workers' dtype (DS_PLANNER_PREFILL_PROFILE) prices them
    assert unpriced_dtypes(settings, fp32, on_gpu=False, prefill_profile=bf16) == {}
    assert unpriced_dtypes(StackConfig().role_settings(), fp32, on_gpu=False,
                           prefill_profile=bf16) == {"prefill": "float32"}
    # on a GPU "auto" is the worker's choice: only a dtype given is compared
    assert unpriced_dtypes(settings, bf16, on_gpu=True) == {}


def test_the_planner_takes_the_prefill_profile_or_says_why_not(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """DS_PLANNER_PREFILL_PROFILE reaches the planner's config; one that cannot price the
    prefill instances (no such file, no dtype said) is left out with the reason, not a
    planner that dies at start; tps it lacks are named (priced in the base dtype)."""
    zen5 = SHIPPED_PROFILES / "smollm2-135m-cpu-1thread-amd-epyc-zen5"
    settings = PlannerSettings(planner_profile=f"{zen5}.json",
                               planner_prefill_profile=f"{zen5}-bfloat16.json")
    prefiller = settings.config().prefill_profile
    assert prefiller is not None and prefiller.dtype == "bfloat16"
    undated = json.loads(Path(f"{zen5}-bfloat16.json").read_text())
    del undated["dtype"]
    (tmp_path / "undated.json").write_text(json.dumps(undated))
    for bad, reason in ((tmp_path / "gone.json", "does not exist"),
                        (tmp_path / "undated.json", "does not say the dtype")):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            config = settings.model_copy(update={"planner_prefill_profile": str(bad)}).config()
        assert config.prefill_profile is None
        assert reason in caplog.text and "pricing them on the planner's profile" in caplog.text
    fp32 = load_profile(f"{zen5}.json")
    two = dataclasses.replace(fp32, by_tp={1: fp32.by_tp[1], 2: fp32.by_tp[1]})
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert prefill_profile_or_none(f"{zen5}-bfloat16.json", two) is not None
    assert "has no tp 2: prefill instances of those are priced in float32" in caplog.text


def test_a_roles_quantized_weights_and_a_16_bit_dtype_are_refused_before_anything_starts(
        ) -> None:
    """Quantized weights compute in float32: a role given both is refused with the flag to
    change (its worker would die at load), whichever setting names them."""
    with pytest.raises(ValueError, match=r"decode workers: int4 weights .* --decode-dtype"):
        StackConfig(dtype="bfloat16", decode_weights="int4")
    with pytest.raises(ValueError, match=r"prefill workers: int8 weights .* --prefill-dtype"):
        StackConfig(weights="int8", prefill_dtype="bfloat16", decode_dtype="float32")
    with pytest.raises(ValueError, match=r"colocated workers: int4 weights .* --dtype"):
        StackConfig(mode="colocated", weights="int4", dtype="float16", prefill_dtype="auto",
                    decode_dtype="auto")
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        StackConfig(prefill_dtype="fp8")
    fine = StackConfig(prefill_dtype="bfloat16", decode_weights="int4")
    assert (fine.dtype_for("prefill"), fine.weights_for("decode")) == ("bfloat16", "int4")


def test_without_settings_a_worker_keeps_its_own_defaults() -> None:
    assert role_env({}, "decode") == {}
    assert ranks_of({}) == 1
    # a role's own setting over every worker's
    assert role_env({"DS_WEIGHTS": "int8", "DS_DECODE_WEIGHTS": "int4"}, "decode") == \
        {"DS_WEIGHTS": "int4"}


def test_the_planner_chooses_the_tp_of_the_roles_up_left_alone() -> None:
    assert fixed_shapes(StackConfig().role_settings()) == {}
    # what the launcher's own environment holds (say, for docker-compose) does not leak in
    inherited = {"DS_TP": "3", "DS_PREFILL_TP": "3", "DS_DECODE_PP": "2"}
    assert fixed_shapes(inherited | StackConfig().role_settings()) == {}
    assert fixed_shapes(StackConfig(prefill_tp=3).role_settings()) == {"prefill": Shape(3)}
    # --tp or --pp other than 1 fixes every role; a role's own wins over it
    assert fixed_shapes(StackConfig(pp=2, decode_tp=3).role_settings()) == {
        "prefill": Shape(1, 2), "decode": Shape(3, 2), "colocated": Shape(1, 2)}


def worker(name: str, kind: str = "decode", tp: int = 1, running: int = 0) -> InstanceInfo:
    return InstanceInfo(instance_id=name, role="colocated" if kind == "chunked" else kind,
                        chunked=kind == "chunked", tp=tp, running=running)


def test_a_plan_of_another_shape_starts_its_workers_and_drains_the_old_ones() -> None:
    live = {"prefill": [worker("p1", "prefill")],
            "decode": [worker("d1", running=3), worker("d2"), worker("d3", tp=2)]}
    start, drain = changes(live, {"prefill": 1, "decode": 2},
                           {"prefill": Shape(2), "decode": ONE})
    assert start == {"prefill": 1, "decode": 0, "colocated": 0, "chunked": 0}
    assert [i.instance_id for i in drain] == ["p1", "d3"]
    # one decode worker fewer: the least loaded of the right shape goes too
    _, drain = changes(live, {"prefill": 1, "decode": 1}, {"prefill": ONE, "decode": ONE})
    assert [i.instance_id for i in drain] == ["d3", "d2"]
    # a kind without a shape (fixed by `up`) keeps workers of any shape
    start, drain = changes(live, {"prefill": 1, "decode": 3}, {})
    assert start["decode"] == 0 and drain == []
    # a switch of mode: the colocated workers drain whatever their shape
    start, drain = changes({"chunked": [worker("c1", "chunked", tp=2)]},
                           {"prefill": 1, "decode": 1}, {"prefill": ONE, "decode": ONE})
    assert (start["prefill"], start["decode"], [i.instance_id for i in drain]) == (1, 1, ["c1"])


def test_the_live_shape_of_a_kind_is_what_most_of_its_workers_have() -> None:
    live = {"prefill": [worker("p1", "prefill", tp=3), worker("p2", "prefill", tp=3),
                        worker("p3", "prefill")],
            "decode": [worker("d1")], "chunked": []}
    assert live_shapes(live) == {"prefill": Shape(3), "decode": ONE}
