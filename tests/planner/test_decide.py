"""The online planner's decision as a pure function: inputs in, plan and record out."""

import dataclasses
import json
import logging

import pytest

from services.planner.budget import ONE, Shape
from services.planner.decide import PlannerConfig, decide
from services.planner.deployer import priced_shapes, runnable_tps
from services.planner.modes import MODES
from services.planner.profiles import SHIPPED_PROFILES, load_profile, shipped_cpu_profile
from shared.engine.meta import read_config
from shared.messages import ReplanRequest, WorkloadSummary
from shared.metrics import SLO

CONFIG = PlannerConfig(load_profile(shipped_cpu_profile(1)), SLO(5.0, 0.25), 0.9, 3,
                       modes=("disaggregated",))


def window(prompt: int, output: int) -> WorkloadSummary:
    return WorkloadSummary(rate_rps=1.0, arrival_cv=1.0, prompt_tokens=[prompt] * 20,
                           output_tokens=[output] * 20)


def test_nothing_is_decided_before_a_workload_is_seen() -> None:
    assert decide(ReplanRequest(reasons=["timer"]), None, CONFIG, now=1.0) is None


def test_the_plan_follows_the_workload_and_a_timer_plans_for_the_last_one() -> None:
    chat = decide(ReplanRequest(reasons=["first full window"], workload=window(16, 24)), None,
                  CONFIG, now=10.0)
    assert chat is not None and chat.target == {"prefill": 1, "decode": 2, "colocated": 0,
                                                "chunked": 0}
    shifted = decide(ReplanRequest(reasons=["prompt lengths changed"],
                                   workload=window(384, 2)), chat.workload, CONFIG, now=20.0)
    assert shifted is not None and shifted.target == {"prefill": 2, "decode": 1, "colocated": 0,
                                                      "chunked": 0}
    again = decide(ReplanRequest(reasons=["timer"]), shifted.workload, CONFIG, now=30.0)
    assert again is not None and again.workload == shifted.workload
    assert again.target == shifted.target and again.record["made_at"] == 30.0


def test_a_record_replays_to_the_same_decision() -> None:
    """What the planner stores is JSON and holds its inputs: deciding again from a stored
    record gives the same record (how a live planner's history is checked)."""
    made = decide(ReplanRequest(reasons=["first full window"], workload=window(200, 40)), None,
                  CONFIG, now=5.0)
    assert made is not None
    stored = json.loads(json.dumps(made.record))
    replayed = decide(ReplanRequest(reasons=stored["reasons"],
                                    workload=WorkloadSummary(**stored["inputs"])),
                      None, CONFIG, now=stored["made_at"])
    assert replayed is not None and json.loads(json.dumps(replayed.record)) == stored


def test_every_mode_is_weighed_and_the_plan_keeps_to_what_can_be_deployed() -> None:
    """Short prompts on this CPU's profile: chunked colocated replicas would serve most; a
    planner configured for disaggregated serving only records that and plans its split."""
    made = decide(ReplanRequest(reasons=["first full window"], workload=window(16, 24)), None,
                  CONFIG, now=1.0)
    assert made is not None
    by_mode = {c.mode: c for c in made.candidates}
    assert set(by_mode) == {"disaggregated", "colocated", "chunked"}
    assert made.plan.mode == "disaggregated" and made.record["mode"] == "disaggregated"
    best = max(made.candidates, key=lambda c: c.goodput_rps)
    assert made.record["best_mode"] == best.mode
    assert [c["mode"] for c in made.record["candidates"]] == ["disaggregated", "colocated",
                                                              "chunked"]
    free = dataclasses.replace(CONFIG, modes=MODES)
    chosen = decide(ReplanRequest(reasons=["first full window"], workload=window(16, 24)),
                    None, free, now=1.0)
    assert chosen is not None and chosen.plan == best


def test_a_budget_too_small_for_what_can_be_deployed_is_a_clear_error() -> None:
    one = dataclasses.replace(CONFIG, budget=1)
    with pytest.raises(ValueError, match="disaggregated serving needs two"):
        decide(ReplanRequest(reasons=["x"], workload=window(16, 24)), None, one, now=1.0)


def test_the_live_mode_stays_unless_another_is_worth_the_switch() -> None:
    """Short prompts on two devices, as profiled: chunked colocated replicas serve ~1.5x
    what 1P+1D does at a 250 ms TPOT, and ~2.2x at 100 ms. A planner that finds the workers
    disaggregated keeps them so for the first (with a margin of 1.8: the switch restarts
    every worker), switches for the second, and records what it found so the decision
    replays."""
    free = dataclasses.replace(CONFIG, budget=2, modes=MODES, switch_margin=1.8)
    chat = ReplanRequest(reasons=["first full window"], workload=window(16, 24))
    fresh = decide(chat, None, free, now=1.0)
    assert fresh is not None and fresh.plan.mode == "chunked"  # nothing live: the best
    by_mode = {c.mode: c for c in fresh.candidates}
    assert 1.0 < by_mode["chunked"].goodput_rps / by_mode["disaggregated"].goodput_rps < 1.8
    kept = decide(chat, None, free, now=1.0, current="disaggregated")
    assert kept is not None and kept.plan == by_mode["disaggregated"]
    assert (kept.record["mode"], kept.record["best_mode"]) == ("disaggregated", "chunked")
    assert kept.record["current_mode"] == "disaggregated"
    assert kept.target == {"prefill": 1, "decode": 1, "colocated": 0, "chunked": 0}
    tight = dataclasses.replace(free, slo=SLO(5.0, 0.1))
    switched = decide(chat, None, tight, now=1.0, current="disaggregated")
    assert switched is not None and switched.target == {"prefill": 0, "decode": 0,
                                                        "colocated": 0, "chunked": 2}
    stored = json.loads(json.dumps(switched.record))
    replayed = decide(ReplanRequest(reasons=stored["reasons"],
                                    workload=WorkloadSummary(**stored["inputs"])),
                      None, tight, now=stored["made_at"], current=stored["current_mode"])
    assert replayed is not None and json.loads(json.dumps(replayed.record)) == stored


def test_the_online_planner_searches_the_profiles_tps_and_keeps_what_up_fixed(
        caplog: pytest.LogCaptureFixture) -> None:
    """A profile where two devices run a step in a third of one's time: 384-token prompts
    on three devices plan one prefill instance of tp 2 (serving 3x on 2 devices) and one
    decode instance; the record says so and replays. A role whose tp `up` fixed keeps it,
    priced as the profile's smallest tp (with a warning) where the profile lacks it."""
    profile = CONFIG.profile
    two = dataclasses.replace(profile, by_tp={1: profile.by_tp[1], 2: profile.by_tp[1].slowed(
        1 / 3, 1 / 3)})
    config = dataclasses.replace(CONFIG, profile=two)
    made = decide(ReplanRequest(reasons=["first full window"], workload=window(384, 2)), None,
                  config, now=1.0)
    assert made is not None
    assert (made.plan.prefill, made.plan.prefill_shape, made.plan.decode) == (1, Shape(2), 1)
    assert made.plan.shapes["prefill"] == Shape(2) and made.plan.devices == 3
    assert made.record["prefill_shape"] == {"tp": 2, "pp": 1} and made.record["fixed"] == {}
    stored = json.loads(json.dumps(made.record))
    again = decide(ReplanRequest(reasons=stored["reasons"],
                                 workload=WorkloadSummary(**stored["inputs"])), None, config,
                   now=stored["made_at"])
    assert again is not None and json.loads(json.dumps(again.record)) == stored
    kept = decide(ReplanRequest(reasons=["x"], workload=window(384, 2)), None,
                  dataclasses.replace(config, fixed={"prefill": ONE}), now=1.0)
    assert kept is not None and kept.plan.prefill_shape == ONE and kept.plan.prefill == 2
    assert kept.record["fixed"] == {"prefill": {"tp": 1, "pp": 1}}
    with caplog.at_level(logging.WARNING):
        priced = priced_shapes({"prefill": Shape(3), "decode": Shape(2)}, two)
    assert priced == {"prefill": ONE, "decode": Shape(2)}
    assert "prefill workers run tp 3 but the profile has tp 1/2 only" in caplog.text


def test_the_planner_searches_only_the_tps_the_workers_can_run() -> None:
    """SmolLM2 has 3 KV heads: tp 2 cannot split it, tp 3 can; on a GPU no parallel
    instance runs (NCCL is not built). The same for the pipelines a profile measured."""
    profile = CONFIG.profile
    co = profile.by_tp[1]
    three = dataclasses.replace(profile, by_tp={1: co, 2: co, 3: co})
    model = read_config("smollm2-135m")
    assert runnable_tps(three, model, on_gpu=False).tps == [1, 3]
    assert runnable_tps(three, model, on_gpu=True).tps == [1]
    only_two = dataclasses.replace(profile, by_tp={2: co})
    assert runnable_tps(only_two, model, on_gpu=False).tps == [2]  # none left: as it was
    # measured pipelines: of a runnable tp, no more stages than layers (30), not on a GPU
    piped = dataclasses.replace(three, pipelines={(1, 2): co, (2, 2): co, (3, 2): co,
                                                  (1, 31): co})
    assert sorted(runnable_tps(piped, model, on_gpu=False).pipelines) == [(1, 2), (3, 2)]
    assert runnable_tps(piped, model, on_gpu=True).pipelines == {}


def test_reshaping_a_role_must_pay_for_itself_like_a_mode_switch() -> None:
    """The two-tp profile's plan for long prompts is a tp 2 prefill instance; while the
    live prefill workers are of one device, the planner keeps their shape unless tp 2 is
    `switch_margin` better, and records the live shapes so the decision replays."""
    profile = CONFIG.profile
    two = dataclasses.replace(profile, by_tp={1: profile.by_tp[1], 2: profile.by_tp[1].slowed(
        1 / 3, 1 / 3)})
    config = dataclasses.replace(CONFIG, profile=two)
    request = ReplanRequest(reasons=["x"], workload=window(384, 2))
    live = {"prefill": ONE, "decode": ONE}
    fresh = decide(request, None, config, now=1.0)
    patient = decide(request, None, dataclasses.replace(config, switch_margin=3.0), now=1.0,
                     current="disaggregated", current_shapes=live)
    eager = decide(request, None, dataclasses.replace(config, switch_margin=1.0), now=1.0,
                   current="disaggregated", current_shapes=live)
    assert fresh is not None and patient is not None and eager is not None
    assert fresh.plan.prefill_shape == Shape(2)
    assert (patient.plan.prefill, patient.plan.prefill_shape) == (2, ONE)
    assert fresh.plan.goodput_rps > patient.plan.goodput_rps  # worth less than 3x
    assert eager.plan == fresh.plan
    assert patient.record["current_shapes"] == {"prefill": {"tp": 1, "pp": 1},
                                                "decode": {"tp": 1, "pp": 1}}
    stored = json.loads(json.dumps(patient.record))
    again = decide(request, None, dataclasses.replace(config, switch_margin=3.0),
                   now=stored["made_at"], current=stored["current_mode"],
                   current_shapes={k: Shape(**v) for k, v in stored["current_shapes"].items()})
    assert again is not None and json.loads(json.dumps(again.record)) == stored
    # workers of the shape planned: nothing to weigh
    same = decide(request, None, dataclasses.replace(config, switch_margin=3.0), now=1.0,
                  current="disaggregated", current_shapes={"prefill": Shape(2), "decode": ONE})
    assert same is not None and same.plan == fresh.plan


def test_live_workers_of_a_tp_the_profile_lacks_never_stop_the_planner() -> None:
    """`up --prefill-tp 3` with a profile of tp 1 only: the role is priced as tp 1 and its
    tp 3 workers stay (the deployer never reshapes a fixed role); workers of such a tp in
    a role the planner may reshape (say, started by docker-compose) cannot be priced, so
    the plan is made as if nothing were live."""
    request = ReplanRequest(reasons=["x"], workload=window(384, 2))
    live = {"prefill": Shape(3), "decode": ONE}
    fixed = dataclasses.replace(CONFIG, fixed=priced_shapes({"prefill": Shape(3)},
                                                            CONFIG.profile))
    kept = decide(request, None, fixed, now=1.0, current="disaggregated", current_shapes=live)
    assert kept is not None and kept.plan.prefill_shape == ONE
    free = decide(request, None, CONFIG, now=1.0, current="disaggregated",
                  current_shapes=live)
    fresh = decide(request, None, CONFIG, now=1.0)
    assert free is not None and fresh is not None and free.plan == fresh.plan


def test_a_prefill_profile_prices_the_disaggregated_prefill_instances_alone() -> None:
    """`up --prefill-dtype bfloat16` with the profile measured in it
    (DS_PLANNER_PREFILL_PROFILE): the disaggregated mode's prefill instances are priced on
    it (on the Zen 5 profiles a bfloat16 prefill is the faster: more goodput), the colocated
    modes, whose workers run float32 for both phases, as without it; the record says the
    dtype and replays."""
    zen5 = SHIPPED_PROFILES / "smollm2-135m-cpu-1thread-amd-epyc-zen5"
    fp32, bf16 = load_profile(f"{zen5}.json"), load_profile(f"{zen5}-bfloat16.json")
    assert bf16.latency(1, 1).prefill_latency_s(512, 512 * 512) < \
        0.9 * fp32.latency(1, 1).prefill_latency_s(512, 512 * 512)
    # long prompts, a decode batch's TPOT to spare: the prefill instances set the goodput
    request = ReplanRequest(reasons=["x"], workload=WorkloadSummary(
        rate_rps=1.0, arrival_cv=1.0, prompt_tokens=[512] * 20, output_tokens=[32] * 20))
    plain = PlannerConfig(fp32, SLO(2.0, 0.1), 0.9, 4)
    mixed = dataclasses.replace(plain, prefill_profile=bf16)
    before, after = (decide(request, None, c, now=1.0) for c in (plain, mixed))
    assert before is not None and after is not None
    by_mode = [{c.mode: c for c in d.candidates} for d in (before, after)]
    assert by_mode[1]["disaggregated"].goodput_rps > 1.05 * by_mode[0]["disaggregated"]\
        .goodput_rps
    for mode in ("colocated", "chunked"):
        assert by_mode[1][mode] == by_mode[0][mode]
    assert (before.record["prefill_dtype"], after.record["prefill_dtype"]) == ("", "bfloat16")
    stored = json.loads(json.dumps(after.record))
    again = decide(ReplanRequest(reasons=stored["reasons"],
                                 workload=WorkloadSummary(**stored["inputs"])),
                   None, mixed, now=stored["made_at"])
    assert again is not None and json.loads(json.dumps(again.record)) == stored


def test_prompts_found_in_the_prefix_caches_need_fewer_prefill_instances() -> None:
    """A window whose prompts the instances found mostly cached (a conversation's turns, a
    shared system prompt: the gateway's events say how many tokens each) is planned with
    their prefill priced as the new tokens after the cached: the split moves devices from
    prefill to decode, and more is served. A summary from before the field plans as if
    every prompt were computed whole."""
    whole = window(384, 24)
    cached = whole.model_copy(update={"cached_tokens": [352] * 20})
    plain = decide(ReplanRequest(reasons=["x"], workload=whole), None, CONFIG, now=1.0)
    found = decide(ReplanRequest(reasons=["x"], workload=cached), None, CONFIG, now=1.0)
    assert plain is not None and found is not None
    assert plain.target["prefill"] == 2 and found.target == {
        "prefill": 1, "decode": 2, "colocated": 0, "chunked": 0}
    assert found.plan.goodput_rps > 2 * plain.plan.goodput_rps
    assert found.record["workload"]["cached_mean"] == 352.0
    assert plain.record["workload"]["cached_mean"] == 0.0
