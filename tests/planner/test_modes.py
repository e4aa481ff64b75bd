"""The choice between disaggregated, colocated and chunked-prefill serving (pure), on
hand-made profiles: which mode wins follows from what a prompt token costs next to a decode
step, and from how tight the TPOT objective is."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from services.planner.budget import ONE, Shape
from services.planner.latency import Contention, PhaseCoefficients
from services.planner.models import model_spec
from services.planner.modes import (
    MODES,
    Candidate,
    best,
    candidates,
    serving_mode,
    worth_switching,
)
from services.planner.placement import Problem
from services.planner.profiles import (
    Profile,
    ProfileError,
    load_profile,
    save_profile,
    with_prefill_of,
)
from shared.metrics import SLO
from shared.workloads import Lengths, Workload


def profile(prompt_token_ms: float, step_ms: float) -> Profile:
    """A device whose steps cost `step_ms` (reading the weights) plus `prompt_token_ms` per
    prompt token, or 1 ms per request decoded; room for 64k tokens of KV."""
    return Profile(model=model_spec("smollm2-135m"), device="hand-made",
                   device_memory_bytes=0,
                   by_tp={1: PhaseCoefficients(prefill=(step_ms, prompt_token_ms, 0.0),
                                               decode_small=(step_ms, 0.0, 1.0),
                                               decode_large=(step_ms, 0.0, 1.0))},
                   l_m=512, max_decode_batch=64, kv_capacity={(1, 1): 1 << 16})


def problem(prof: Profile, prompt: int, output: int, slo: SLO, rate: float) -> Problem:
    lengths = Lengths(np.array([prompt] * 16), np.array([output] * 16))
    return Problem(prof, Workload(lengths), slo, rate, 1, 2, 0.9, num_requests=200,
                   workers=1)


def by_mode(found: list[Candidate]) -> dict[str, Candidate]:
    return {c.mode: c for c in found}


def test_long_prompts_and_a_tight_tpot_pick_disaggregated() -> None:
    """A 512-token prompt takes 0.5 s, a decode step 20 ms: a colocated replica's prefill
    stalls its running decodes by 25 steps, past a 30 ms TPOT; a decode instance never
    stalls, so disaggregation serves more on the same two devices."""
    found = candidates(problem(profile(1.0, 20.0), 512, 32, SLO(5.0, 0.030), 0.5), budget=2)
    modes = by_mode(found)
    assert set(modes) == {"disaggregated", "colocated", "chunked"}
    assert modes["disaggregated"].layout == "1 prefill + 1 decode"
    assert modes["colocated"].layout == "2 colocated"
    assert best(found).mode == "disaggregated"
    assert modes["disaggregated"].goodput_rps > 1.3 * max(
        modes["colocated"].goodput_rps, modes["chunked"].goodput_rps)


def test_cheap_prompts_and_long_outputs_pick_colocated() -> None:
    """Prompt tokens nearly free next to a 30 ms decode step: a prefill instance would idle
    while one decode instance does all the work; two colocated replicas both decode."""
    found = candidates(problem(profile(0.01, 30.0), 64, 256, SLO(5.0, 0.2), 1.0), budget=2)
    modes = by_mode(found)
    assert best(found).mode in ("colocated", "chunked")
    assert best(found).goodput_rps > 1.5 * modes["disaggregated"].goodput_rps
    # chunked prefill folds each prompt into a decode step instead of a step of its own
    # (each costing the 30 ms of reading the weights): more than either
    assert best(found).mode == "chunked"
    assert modes["chunked"].goodput_rps > 1.2 * modes["colocated"].goodput_rps


def test_a_loose_tpot_lets_colocation_win_even_on_long_prompts() -> None:
    """The same long prompts as the first test: once the TPOT objective tolerates a prefill
    stall, two devices that both work beat one that only prefills."""
    prof = profile(1.0, 20.0)
    tight = best(candidates(problem(prof, 512, 32, SLO(5.0, 0.030), 0.5), budget=2))
    loose = best(candidates(problem(prof, 512, 32, SLO(5.0, 1.0), 0.5), budget=2))
    assert tight.mode == "disaggregated" and loose.mode != "disaggregated"


def test_one_device_cannot_disaggregate_and_the_split_follows_the_budget() -> None:
    prof = profile(1.0, 20.0)
    one = candidates(problem(prof, 512, 32, SLO(5.0, 0.030), 0.5), budget=1)
    assert [c.mode for c in one] == ["colocated", "chunked"]
    assert all(c.colocated == 1 and c.devices == 1 for c in one)
    four = by_mode(candidates(problem(prof, 512, 32, SLO(5.0, 0.030), 1.0), budget=4))
    assert four["disaggregated"].devices == 4 and four["colocated"].colocated == 4
    assert four["disaggregated"].per_device_rps == pytest.approx(
        four["disaggregated"].goodput_rps / 4)


def test_when_no_mode_meets_the_objectives_the_best_attainment_wins() -> None:
    found = [Candidate("disaggregated", 1, 1, 0, 0.0, 0.40),
             Candidate("colocated", 0, 0, 2, 0.0, 0.55),
             Candidate("chunked", 0, 0, 2, 0.0, 0.50)]
    assert best(found).mode == "colocated"
    assert best([*found[:2], Candidate("chunked", 0, 0, 2, 0.1, 0.2)]).mode == "chunked"


def test_the_serving_mode_is_what_most_live_workers_serve() -> None:
    assert serving_mode({"prefill": 1, "decode": 2}) == "disaggregated"
    assert serving_mode({"prefill": 1, "decode": 0, "chunked": 0}) is None  # serves nothing
    assert serving_mode({"prefill": 1, "decode": 1, "chunked": 1}) == "disaggregated"
    # mid-switch: the new mode's workers started, the old ones not yet drained
    assert serving_mode({"prefill": 1, "decode": 1, "chunked": 3}) == "chunked"
    assert serving_mode({"colocated": 2}) == "colocated"
    assert serving_mode({}) is None


def test_a_mode_switch_must_pay_for_itself() -> None:
    stay = Candidate("disaggregated", 1, 1, 0, goodput_rps=1.0, attainment=1.0)
    assert worth_switching(dataclasses.replace(stay, mode="chunked", goodput_rps=1.3), stay,
                           1.2)
    assert not worth_switching(dataclasses.replace(stay, mode="chunked", goodput_rps=1.1),
                               stay, 1.2)
    # neither meets the objectives at any rate: attainment at the rate decides
    lost = dataclasses.replace(stay, goodput_rps=0.0, attainment=0.5)
    assert worth_switching(dataclasses.replace(lost, mode="colocated", attainment=0.7), lost,
                           1.2)
    assert not worth_switching(dataclasses.replace(lost, mode="colocated", attainment=0.55),
                               lost, 1.2)


def test_a_candidate_names_the_workers_a_deployer_starts() -> None:
    chunked = Candidate("chunked", 0, 0, 2, goodput_rps=1.0, attainment=1.0)
    assert chunked.deployment == {"prefill": 0, "decode": 0, "colocated": 0, "chunked": 2}
    split = Candidate("disaggregated", 2, 1, 0, goodput_rps=1.0, attainment=1.0)
    assert split.deployment == {"prefill": 2, "decode": 1, "colocated": 0, "chunked": 0}


def two_tps(prompt_token_ms: float, step_ms: float) -> Profile:
    """`profile`'s device, and instances of two of them (tp 2) at a third of its times."""
    one = profile(prompt_token_ms, step_ms)
    return dataclasses.replace(one, by_tp={1: one.by_tp[1], 2: one.by_tp[1].slowed(
        1 / 3, 1 / 3, 0.0, 0.0)}, kv_capacity={(1, 1): 1 << 16, (2, 1): 1 << 17})


def test_each_role_takes_the_tp_that_meets_its_objective_within_the_budget() -> None:
    """A 512-token prompt takes 0.53 s on one device, past the 0.3 s TTFT; on two it takes
    0.18 s. On three devices the plan is one prefill instance of tp 2 and one decode
    instance of one device, and a colocated replica of tp 2 (one device left idle)."""
    found = by_mode(candidates(problem(two_tps(1.0, 20.0), 512, 32, SLO(0.3, 0.030), 0.5),
                               budget=3))
    split = found["disaggregated"]
    assert (split.prefill, split.prefill_shape, split.decode, split.decode_shape) == (
        1, Shape(2), 1, ONE)
    assert split.devices == 3 and split.goodput_rps > 0
    assert split.layout == "1 prefill tp2 + 1 decode"
    assert split.shapes["prefill"] == Shape(2) and split.shapes["decode"] == ONE
    colocated = found["colocated"]
    assert (colocated.colocated, colocated.colocated_shape, colocated.devices) == (1, Shape(2), 2)
    assert colocated.goodput_rps > 0 and colocated.layout == "1 colocated tp2"
    assert best(list(found.values())).goodput_rps > 0


def test_a_shape_up_fixed_is_kept_and_one_device_shapes_plan_as_before() -> None:
    prob = problem(two_tps(1.0, 20.0), 512, 32, SLO(0.3, 0.030), 0.5)
    fixed = by_mode(candidates(prob, budget=3, fixed={"prefill": ONE, "colocated": ONE}))
    assert fixed["disaggregated"].prefill_shape == ONE
    assert fixed["disaggregated"].prefill == 2  # the third device: another prefill instance
    assert fixed["disaggregated"].goodput_rps == 0  # no tp 1 prefill meets the TTFT
    assert fixed["colocated"].colocated_shape == ONE and fixed["colocated"].colocated == 3
    # a profile of one tp: every instance one device, the budget used whole
    plain = by_mode(candidates(problem(profile(1.0, 20.0), 512, 32, SLO(5.0, 0.030), 0.5),
                               budget=3))
    assert all(c.devices == 3 and set(c.shapes.values()) == {ONE} for c in plain.values())


def test_shapes_too_wide_for_a_disaggregated_pair_leave_the_colocated_modes() -> None:
    """Every role fixed at tp 2 (`up --tp 2`) on three devices: no prefill and decode pair
    fits, so only the colocated modes are weighed, one replica of two devices each; a
    profile of tp 2 only on two devices the same."""
    prof = two_tps(1.0, 20.0)
    prob = problem(prof, 512, 32, SLO(0.3, 0.030), 0.5)
    tp2 = {"prefill": Shape(2), "decode": Shape(2), "colocated": Shape(2)}
    found = candidates(prob, budget=3, fixed=tp2)
    assert [c.mode for c in found] == ["colocated", "chunked"]
    assert all((c.colocated, c.colocated_shape, c.devices) == (1, Shape(2), 2) for c in found)
    only_tp2 = dataclasses.replace(prof, by_tp={2: prof.by_tp[2]})
    found = candidates(problem(only_tp2, 512, 32, SLO(0.3, 0.030), 0.5), budget=2)
    assert [c.mode for c in found] == ["colocated", "chunked"]


def with_pipeline(one: Profile, speedup: float) -> Profile:
    """`one` with a tp 1 pp 2 pipeline measured at `speedup` x one device's times (latency
    and decode round alike), room for twice the KV."""
    return dataclasses.replace(one, pipelines={(1, 2): one.by_tp[1].slowed(
        1 / speedup, 1 / speedup, 0.0, 0.0)}, kv_capacity={(1, 1): 1 << 16, (1, 2): 1 << 17})


def with_stage_share(piped: Profile, share: float) -> Profile:
    return dataclasses.replace(piped, pipelines={
        shape: dataclasses.replace(co, prefill_stage=share)
        for shape, co in piped.pipelines.items()})


def test_a_pipeline_whose_stages_overlap_less_serves_fewer_prompts() -> None:
    """The same pp 2 prefill pipeline, its stage busy half its prompts' latency (the paper's
    even split) or 0.9 of it (measured: the hand-offs, an uneven split): the second takes
    prompts in nearly one at a time, so the plan's goodput falls."""
    slo = SLO(0.3, 0.030)
    piped = with_pipeline(profile(1.0, 20.0), 3.0)
    goodput = {share: by_mode(candidates(problem(with_stage_share(piped, share), 512, 32, slo,
                                                 0.5), budget=3))["disaggregated"]
               for share in (0.5, 0.9)}
    assert goodput[0.5].prefill_shape == Shape(1, 2)
    assert goodput[0.9].goodput_rps < 0.8 * goodput[0.5].goodput_rps


def test_a_pipeline_is_weighed_as_measured_and_only_where_measured() -> None:
    """A 512-token prompt takes 0.53 s on one device, past the 0.3 s TTFT. A pipeline of two
    measured at a third of one device's latency serves it: the prefill role takes it. One
    measured no faster than a device (a request still crosses every stage) meets it no better
    than one device, and without a measured pipeline none is weighed in any mode: the
    paper's model would have called the pp 2 prefill twice as fast as one device."""
    slo = SLO(0.3, 0.030)
    fast = by_mode(candidates(problem(with_pipeline(profile(1.0, 20.0), 3.0), 512, 32, slo,
                                      0.5), budget=3))["disaggregated"]
    assert (fast.prefill, fast.prefill_shape, fast.decode, fast.decode_shape) == (
        1, Shape(1, 2), 1, ONE)
    assert fast.layout == "1 prefill tp1 pp2 + 1 decode" and fast.goodput_rps > 0
    slow = by_mode(candidates(problem(with_pipeline(profile(1.0, 20.0), 1.0), 512, 32, slo,
                                      0.5), budget=3))["disaggregated"]
    assert Shape(1, 2) not in slow.shapes.values()
    assert slow.goodput_rps == 0  # no one-device prefill meets it, nor that pipeline
    found = by_mode(candidates(problem(profile(1.0, 20.0), 512, 32, slo, 0.5), budget=3))
    assert all(Shape(1, 2) not in c.shapes.values() for c in found.values())


def test_measured_pipeline_coefficients_are_whole_latencies_and_rounds(
        tmp_path: Path) -> None:
    one = profile(1.0, 20.0)
    paper, measured = one.latency(1, 2), with_pipeline(one, 1.0).latency(1, 2)
    assert not paper.rounds and measured.rounds and measured.pp == 2
    # the paper's model: a decode step's time over the stages; a measured round as it is
    assert paper.decode_step_s(8, 800) == pytest.approx(measured.decode_step_s(8, 800) / 2)
    assert measured.decode_step_s(8, 800) == pytest.approx(one.latency(1, 1).decode_step_s(
        8, 800))
    # a prompt batch's latency as measured; the first stage free after its share
    assert measured.prefill_latency_s(512, 512**2) == pytest.approx(0.532)
    assert measured.prefill_stage_s(512, 512**2) == pytest.approx(0.266)
    # a stage share measured as the pipeline ran (its slowest stage, the hand-offs): the
    # next prompt starts after that share of the latency, not after half of it
    staged = with_stage_share(with_pipeline(one, 1.0), 0.6)
    assert staged.latency(1, 2).prefill_stage_s(512, 512**2) == pytest.approx(0.532 * 0.6)
    assert staged.latency(1, 2).prefill_latency_s(512, 512**2) == pytest.approx(0.532)
    path = tmp_path / "p.json"
    save_profile(with_stage_share(with_pipeline(one, 2.0), 0.6), path)
    again = load_profile(path)
    assert again.pipelines == with_stage_share(with_pipeline(one, 2.0), 0.6).pipelines
    assert again.pipelines[(1, 2)].prefill_stage == 0.6 and again.tps == [1]
    save_profile(one, path)  # a profile without pipelines writes none, and reads none
    assert "pipelines" not in json.loads(path.read_text()) and not load_profile(path).pipelines


def test_a_prefill_profile_prices_the_prefill_instances_and_nothing_else() -> None:
    """A profile measured in another compute dtype (here prompts at half the cost, decode
    steps at twice: bfloat16 on a CPU without fused bfloat16 decode layers) prices only the
    disaggregated prefill instances: on 512-token prompts against a 0.6 s TTFT the pair then
    serves more; the decode steps, the KV room, the decode's contention and every shape the
    float32 profile measured stay (a shape the other did not measure prefills as float32)."""
    one = profile(1.0, 20.0)
    fp32 = dataclasses.replace(one, device="cpu-1threads", dtype="float32",
                               by_tp={1: one.by_tp[1], 2: one.by_tp[1].scaled(1.5)},
                               pipelines={(1, 2): one.by_tp[1].scaled(1.2)},
                               contention=Contention(decode_by_prefill=1.1,
                                                     prefill_by_decode=1.3))
    bf16 = dataclasses.replace(profile(0.5, 40.0), device="cpu-1threads", dtype="bfloat16",
                               l_m=1024, kv_capacity={(1, 1): 1 << 10},
                               contention=Contention(decode_by_prefill=1.5,
                                                     prefill_by_decode=1.05))
    mixed = with_prefill_of(fp32, bf16)
    assert mixed.by_tp[1].prefill == bf16.by_tp[1].prefill
    assert mixed.by_tp[1].decode_small == fp32.by_tp[1].decode_small
    assert mixed.by_tp[2] == fp32.by_tp[2] and mixed.pipelines == fp32.pipelines
    assert (mixed.l_m, mixed.kv_capacity, mixed.dtype) == (1024, fp32.kv_capacity, "float32")
    assert (mixed.contention.decode_by_prefill, mixed.contention.prefill_by_decode) == (1.1, 1.05)
    slo = SLO(0.6, 0.1)
    alone = by_mode(candidates(problem(fp32, 512, 16, slo, 0.5), budget=2, modes=MODES[:1],
                               fixed={"prefill": ONE, "decode": ONE}))
    paired = by_mode(candidates(problem(mixed, 512, 16, slo, 0.5), budget=2, modes=MODES[:1],
                                fixed={"prefill": ONE, "decode": ONE}))
    assert paired["disaggregated"].goodput_rps > 1.5 * alone["disaggregated"].goodput_rps
    other_model = dataclasses.replace(bf16, model=model_spec("facebook/opt-13b"))
    other_tp = dataclasses.replace(bf16, by_tp={4: bf16.by_tp[1]})
    gpu = dataclasses.replace(bf16, device="NVIDIA H100 80GB HBM3")
    for wrong, reason in ((other_model, "one model serves both"), (other_tp, "none in common"),
                          (gpu, "only between CPU instances")):
        with pytest.raises(ProfileError, match=reason):
            with_prefill_of(fp32, wrong)
