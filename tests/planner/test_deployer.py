"""The workers the planner's deployer starts run as `distserve up` started their role's:
the launcher hands the planner every role's weights, tp and pp, and the deployer gives a new
worker its role's."""

from __future__ import annotations

from services.launcher import StackConfig
from services.planner.deployer import ranks_of, role_env


def test_a_new_worker_gets_its_roles_weights_tp_and_pp_from_up() -> None:
    settings = StackConfig(decode_weights="int4", prefill_tp=3, pp=2).role_settings()
    assert role_env(settings, "decode") == {"DS_WEIGHTS": "int4", "DS_TP": "1", "DS_PP": "2"}
    assert role_env(settings, "prefill") == {"DS_WEIGHTS": "auto", "DS_TP": "3", "DS_PP": "2"}
    # colocated workers serve both phases: every worker's settings
    assert role_env(settings, "colocated") == {"DS_WEIGHTS": "auto", "DS_TP": "1", "DS_PP": "2"}
    assert ranks_of(role_env(settings, "prefill")) == 6


def test_without_settings_a_worker_keeps_its_own_defaults() -> None:
    assert role_env({}, "decode") == {}
    assert ranks_of({}) == 1
    # a role's own setting over every worker's
    assert role_env({"DS_WEIGHTS": "int8", "DS_DECODE_WEIGHTS": "int4"}, "decode") == \
        {"DS_WEIGHTS": "int4"}
