"""The latency model calibrated on the running stack's step timings (pure): steps slower
than the profile move the phase's scale by as much, and the plan follows."""

import dataclasses
import random

import numpy as np
import pytest

from distserve.bench.steps import calibrator_of
from services.planner.calibration import (
    ALONE,
    MEAN_FROM,
    MOMENTS,
    Calibration,
    Calibrator,
    fit_steps,
    predicted_s,
    replan_reason,
)
from services.planner.decide import PlannerConfig, decide
from services.planner.latency import Contention, LatencyModel
from services.planner.profiles import load_profile, shipped_cpu_profile
from services.planner.timeline import Timeline
from shared.engine.request import Request, SamplingParams
from shared.engine.scheduler import ScheduledChunk, SchedulerOutput, StepShape
from shared.messages import ReplanRequest, WorkloadSummary
from shared.metrics import SLO
from shared.state import StepSample

PROFILE = load_profile(shipped_cpu_profile(1))
LATENCY = PROFILE.latency(1, 1)


def recorded_steps(prefill_slower: float, decode_slower: float, n: int = 120,
                   seed: int = 0, latency: LatencyModel = LATENCY) -> list[StepSample]:
    """Steps as a worker heartbeats them: prompts of 64-512 tokens, decode batches of 1-24
    at contexts of 100-600 tokens, timed `*_slower` x `latency` with +-8% noise."""
    rng = random.Random(seed)
    out = []
    for step in range(1, n + 1):
        noise = rng.uniform(0.92, 1.08)
        if step % 3 == 0:
            prompts = [rng.randint(64, 512) for _ in range(rng.randint(1, 2))]
            seconds = latency.prefill_latency_s(sum(prompts), sum(p * p for p in prompts))
            out.append(StepSample(step=step, prompts=prompts,
                                  seconds=seconds * prefill_slower * noise))
        else:
            batch = rng.randint(1, 24)
            context = sum(rng.randint(100, 600) for _ in range(batch))
            seconds = latency.decode_step_s(batch, context) * decode_slower * noise
            out.append(StepSample(step=step, batch=batch, context=context, seconds=seconds))
    return out


def test_decode_steps_20_percent_slower_move_the_decode_coefficients_by_as_much() -> None:
    calibrator = Calibrator(LATENCY)
    assert calibrator.observe("decode-0", recorded_steps(1.0, 1.2)) == 120
    found = calibrator.calibration()
    assert found.decode == pytest.approx(1.2, rel=0.03)
    assert found.prefill == pytest.approx(1.0, rel=0.03)
    assert (found.prefill_steps, found.decode_steps) == (40, 80)
    piped = dataclasses.replace(PROFILE, pipelines={(1, 2): PROFILE.by_tp[1]})
    applied = found.apply(piped)
    co = PROFILE.by_tp[1]
    for fitted in (applied.by_tp[1], applied.pipelines[(1, 2)]):  # a measured pipeline too
        for before, after in zip(co.decode_small + co.decode_large, fitted.decode_small +
                                 fitted.decode_large, strict=True):
            assert after == pytest.approx(before * 1.2, rel=0.03)
        assert fitted.prefill[1:] == pytest.approx(co.prefill[1:], rel=0.03)
        for tokens in (64, 256, 512):  # a prompt step priced as before (a + b.n + c.n^2)
            assert sum(k * tokens ** i for i, k in enumerate(fitted.prefill)) == \
                pytest.approx(sum(k * tokens ** i for i, k in enumerate(co.prefill)), rel=0.03)


def test_each_workers_steps_are_compared_with_its_own_shapes_prediction() -> None:
    """A tp 3 worker whose steps take a quarter of tp 1's, as its profile says, and a tp 1
    worker as profiled: the calibration stays at 1.0 (against tp 1's prediction the tp 3
    steps would read as 0.25x and move every plan)."""
    tp3 = dataclasses.replace(LATENCY, coefficients=LATENCY.coefficients.slowed(0.25, 0.25))
    calibrator = Calibrator(LATENCY)
    calibrator.observe("prefill-tp3", recorded_steps(1.0, 1.0, latency=tp3), tp3)
    calibrator.observe("decode-0", recorded_steps(1.0, 1.0, seed=1))
    found = calibrator.calibration()
    assert found.prefill == pytest.approx(1.0, rel=0.03)
    assert found.decode == pytest.approx(1.0, rel=0.03)
    unpriced = Calibrator(LATENCY)
    unpriced.observe("prefill-tp3", recorded_steps(1.0, 1.0, latency=tp3))
    assert unpriced.calibration().prefill < 0.3  # what the profiler would have read


def test_steps_already_seen_are_not_counted_twice_and_a_phase_needs_enough_steps() -> None:
    calibrator = Calibrator(LATENCY, min_steps=10, min_seconds=float("inf"))
    steps = recorded_steps(1.5, 1.5, n=12)
    assert calibrator.observe("p", steps[:8]) == 8
    assert calibrator.observe("p", steps) == 4  # the heartbeat repeats the last steps
    assert calibrator.observe("p", steps) == 0
    found = calibrator.calibration()
    assert (found.prefill_steps, found.decode_steps) == (4, 8)
    assert (found.prefill, found.decode) == (1.0, 1.0)  # too few steps to move either
    assert calibrator.observe("q", steps) == 12  # another instance counts on its own
    assert calibrator.calibration().decode == pytest.approx(1.5, rel=0.1)
    # or enough seconds of them: the 4 prompts took more than 2 s together
    assert sum(s.seconds for s in steps if s.prompts) > 2.0
    by_time = Calibrator(LATENCY, min_steps=10, min_seconds=2.0)
    by_time.observe("p", steps)
    assert by_time.calibration().prefill == pytest.approx(1.5, rel=0.1)


def test_a_slower_decode_side_moves_the_plan_toward_decode() -> None:
    """256-token prompts, 32-token outputs on 4 devices: as profiled, prefill is the
    bottleneck (3 prefill + 1 decode); with decode steps 20% slower than profiled, as the
    stack measured them, the planner gives decode a second instance."""
    config = PlannerConfig(PROFILE, SLO(5.0, 0.25), 0.9, 4, modes=("disaggregated",),
                           batch_tokens=512, max_running=64)
    window = WorkloadSummary(rate_rps=1.0, arrival_cv=1.0, prompt_tokens=[256] * 20,
                             output_tokens=[32] * 20)
    request = ReplanRequest(reasons=["first full window"], workload=window)
    calibrator = Calibrator(LATENCY)
    calibrator.observe("decode-0", recorded_steps(1.0, 1.2))
    as_profiled = decide(request, None, config, now=1.0)
    measured = decide(request, None, config, now=1.0, calibration=calibrator.calibration())
    assert as_profiled is not None and measured is not None
    assert (as_profiled.plan.prefill, as_profiled.plan.decode) == (3, 1)
    assert (measured.plan.prefill, measured.plan.decode) == (2, 2)
    assert measured.record["calibration"]["decode"] == pytest.approx(1.2, rel=0.03)


def test_the_planner_plans_again_once_the_calibration_moves_far_enough() -> None:
    base = Calibration()
    assert Calibration(decode=1.25).differs(base, 1.2)
    assert Calibration(prefill=0.8).differs(base, 1.2)
    assert not Calibration(prefill=1.1, decode=0.9).differs(base, 1.2)
    moved = Calibration(prefill=1.05, decode=1.3, prefill_steps=12, decode_steps=40)
    reason = replan_reason(moved, base, 1.2, min_steps=10)
    assert reason is not None and "decode 1.30x" in reason
    assert replan_reason(moved, moved, 1.2, 10) is None  # planned on it already
    assert replan_reason(moved.model_copy(update={"prefill_steps": 9}), base, 1.2, 10) is None


def test_the_engine_reports_every_step_as_the_model_prices_it() -> None:
    """Whole prompts, decodes alone, and a mixed step (chunked prefill, a failover replay
    beside decodes): its chunks, the tokens each had computed before, and its decodes."""
    def request(n: int) -> Request:
        return Request(f"r{n}", list(range(n)), SamplingParams(max_tokens=4),
                       eos_ids=frozenset({0}))

    a, b, c = request(100), request(30), request(50)
    assert SchedulerOutput([ScheduledChunk(a, 0, 100), ScheduledChunk(b, 0, 30)], []).shape() \
        == StepShape((100, 30), 0, 0)
    assert SchedulerOutput([], [ScheduledChunk(a, 100, 1), ScheduledChunk(c, 60, 1)]).shape() \
        == StepShape((), 2, 162)
    assert SchedulerOutput([ScheduledChunk(b, 0, 30)], [ScheduledChunk(a, 100, 1)]).shape() \
        == StepShape((30,), 1, 101)
    assert SchedulerOutput([ScheduledChunk(a, 64, 36), ScheduledChunk(b, 0, 8)], []).shape() \
        == StepShape((36, 8), 0, 0, (64, 0))
    assert SchedulerOutput([], []).shape() is None


def chunked_steps(chunk_slower: float, decode_slower: float, n: int = 90,
                  seed: int = 5) -> list[StepSample]:
    """A chunked replica's steps: two in three prompt chunks of 32-480 tokens (a prompt's
    later chunk attends to the 0-512 tokens before it) with 4-24 decodes riding along,
    the chunks' part `chunk_slower` x the profile and the decodes' `decode_slower` x; the
    rest decodes alone, `decode_slower` x; +-5% noise."""
    rng = random.Random(seed)
    out = []
    for step in range(1, n + 1):
        batch = rng.randint(4, 24)
        context = sum(rng.randint(200, 700) for _ in range(batch))
        noise = rng.uniform(0.95, 1.05)
        if step % 3:
            length, done = rng.randint(32, 480), rng.choice([0, 0, rng.randint(64, 512)])
            own = LATENCY.prefill_latency_s(length, length**2, length * done)
            seconds = chunk_slower * own + decode_slower * LATENCY.riding_ms(batch, context) / 1e3
            out.append(StepSample(step=step, prompts=[length], done=[done] if done else [],
                                  batch=batch, context=context, seconds=seconds * noise))
        else:
            seconds = decode_slower * LATENCY.decode_step_s(batch, context) * noise
            out.append(StepSample(step=step, batch=batch, context=context, seconds=seconds))
    return out


def test_chunked_steps_are_calibrated_with_their_decodes_priced_by_the_decode_phase() -> None:
    """A chunked replica runs few steps of whole prompts: its prompt tokens are timed in
    mixed steps. The decodes riding along are priced at the decode phase's correction
    (fitted on the decodes alone, 1.6x), so the chunks' own 1.1x is found, not the mix."""
    calibrator = Calibrator(LATENCY)
    calibrator.observe("colocated-0", chunked_steps(1.1, 1.6))
    found = calibrator.calibration()
    assert (found.prefill_steps, found.decode_steps) == (60, 30)
    assert found.decode == pytest.approx(1.6, rel=0.03)
    assert (found.prefill_fit, found.prefill) == ("scale", pytest.approx(1.1, rel=0.03))
    # what the decodes add is a large share of these steps: had they been priced as
    # profiled, the chunks' scale would have carried their slowdown
    mixed = [s for s in chunked_steps(1.1, 1.6) if s.prompts]
    blended = float(np.median([s.seconds / (LATENCY.prefill_latency_s(
        s.prompts[0], s.prompts[0]**2, s.prompts[0] * (s.done or [0])[0])
        + LATENCY.riding_ms(s.batch, s.context) / 1e3) for s in mixed]))
    assert blended > 1.16
    # and the simulator prices such a step as measured: the chunk corrected, the decodes too
    fitted = found.apply(PROFILE).latency(1, 1)
    step = 1.1 * LATENCY.prefill_latency_s(256, 256 * 256) + \
        1.6 * LATENCY.riding_ms(16, 16 * 400) / 1e3
    assert fitted.prefill_latency_s(256, 256 * 256) + fitted.riding_ms(16, 16 * 400) / 1e3 \
        == pytest.approx(step, rel=0.03)


def test_chunks_the_decodes_riding_along_outweigh_say_nothing_of_the_prefill_phase() -> None:
    """A chunk of a few tokens beside 32 long decodes is four fifths decodes: what is left of
    it once they are priced is noise, so such steps are not fitted on (a level needs its
    minimum of the others), nor do they fail the fit."""
    rng = random.Random(2)
    steps = []
    for step in range(1, 25):
        n = rng.randint(1, 16)
        own = LATENCY.prefill_latency_s(n, n * n, n * 600)
        riding = LATENCY.riding_ms(32, 32 * 1000) / 1e3
        steps.append(StepSample(step=step, prompts=[n], done=[600], batch=32, context=32_000,
                                seconds=(own + 1.3 * riding) * rng.uniform(0.9, 1.1)))
    calibrator = Calibrator(LATENCY)
    calibrator.observe("colocated-0", steps)
    found = calibrator.calibration()
    assert found.prefill_steps == 24  # heard, and counted
    assert (found.prefill_basis, found.prefill) == ("profile", 1.0)  # not fitted on them


def test_a_fixed_cost_a_step_is_fitted_as_one_and_not_scaled_up_to_long_prompts() -> None:
    """Short prompts, 1-3 a step, each step 34 ms longer than profiled (as the 16-token
    steps of the development VM, whose 512-token steps match the profile): the calibrator
    fits a fixed time a step, so a 512-token step is priced ~3% slower, not ~40%."""
    rng = random.Random(1)
    steps = []
    for step in range(1, 41):
        prompts = [rng.randint(12, 20) for _ in range(rng.randint(1, 3))]
        seconds = LATENCY.prefill_latency_s(sum(prompts), sum(p * p for p in prompts)) + 0.034
        steps.append(StepSample(step=step, prompts=prompts,
                                seconds=seconds * rng.uniform(0.97, 1.03)))
    calibrator = Calibrator(LATENCY)
    calibrator.observe("prefill-0", steps)
    found = calibrator.calibration()
    assert found.prefill_fit == "offset" and found.prefill > 1.25  # at the live steps
    assert found.prefill_offset_s == pytest.approx(0.034, abs=0.006)
    assert "ms a step fits best" in found.describe("prefill")
    long = found.apply(PROFILE).latency(1, 1).prefill_latency_s(512, 512 * 512)
    assert long / LATENCY.prefill_latency_s(512, 512 * 512) == pytest.approx(1.033, abs=0.01)
    assert found.decode_fit == "scale" and found.decode == 1.0  # no decode step seen


def test_steps_of_one_size_cannot_tell_a_scale_from_a_fixed_time() -> None:
    """Every step the same (predicted 100 ms, measured 150 ms +-2%): both fits explain it;
    the fixed time is kept, which prices other sizes by what was measured, not by a ratio."""
    rng = random.Random(2)
    alike = [(0.1, 0.15 * rng.uniform(0.98, 1.02)) for _ in range(30)]
    ratio, fit, offset_s = fit_steps(alike)
    assert (fit, ratio) == ("offset", pytest.approx(1.5, rel=0.02))
    assert offset_s == pytest.approx(0.05, rel=0.05)
    # the same slowdown over steps of 50-400 ms is a scale
    spread = [(p, 1.5 * p * rng.uniform(0.98, 1.02)) for p in np.linspace(0.05, 0.4, 30)]
    assert fit_steps(spread)[1:] == ("scale", 0.0)


def test_a_fit_is_set_at_its_mean_so_steps_add_up_to_what_they_took() -> None:
    """Steps at 1.0x their prediction but one in ten at 2.0x (a spell beside other work): the
    median says 1.0x, but a request's time is its steps' sum; the level is their mean,
    1.1x, either fit (a scale over steps of many sizes, a fixed time over steps of one)."""
    rng = random.Random(5)
    sizes = rng.choices([0.03, 0.05, 0.1, 0.2], k=200)
    spread = [(p, p * (2.0 if k % 10 == 0 else 1.0)) for k, p in enumerate(sizes)]
    ratio, fit, _ = fit_steps(spread)
    assert (fit, ratio) == ("scale", pytest.approx(1.1, rel=0.01))
    alike = [(0.03, 0.03 * (2.0 if k % 10 == 0 else 1.0)) for k in range(200)]
    ratio, fit, offset_s = fit_steps(alike, constant_s=0.02)
    assert fit == "offset" and offset_s == pytest.approx(0.003, rel=0.01)
    total = sum(m for _, m in alike)
    assert sum(p + offset_s for p, _ in alike) == pytest.approx(total, rel=1e-6)
    # a scale adds up too where short steps ran slower than the long (almost half of the
    # steps, a sixth of the time): at the total, 1.05x, not the mean ratio, 1.14x
    shaped = [(p, p * (1.3 if p < 0.1 else 1.0)) for p in sizes]
    ratio, fit, _ = fit_steps(shaped)
    assert fit == "scale"
    assert sum(ratio * p for p, _ in shaped) == pytest.approx(sum(m for _, m in shaped))
    # over a few steps one stalled one would move the mean by a replan's worth: the median
    few = [(p, p * (3.0 if k == 0 else 1.0)) for k, p in enumerate(sizes[:MEAN_FROM - 1])]
    assert fit_steps(few)[0] == pytest.approx(1.0)
    # a fixed time whose mean is beyond the model's constant is a slowdown: a scale
    stalled = [(0.03, 0.03 + (0.2 if k % 10 == 0 else 0.0)) for k in range(200)]
    assert fit_steps(stalled, constant_s=0.01)[1] == "scale"


def test_a_host_much_faster_than_the_profile_is_fitted_as_a_scale() -> None:
    """Decode steps of one size at 0.4x the profile: a fixed time a step would be below the
    model's constant (negative small steps); the scale prices them right."""
    steps = [StepSample(step=i, batch=b, context=b * 300,
                        seconds=0.4 * LATENCY.decode_step_s(b, b * 300))
             for i, b in enumerate([6, 7, 8] * 10, start=1)]
    calibrator = Calibrator(LATENCY)
    calibrator.observe("decode-0", steps)
    found = calibrator.calibration()
    assert (found.decode_fit, found.decode) == ("scale", pytest.approx(0.4))
    fitted = found.apply(PROFILE).latency(1, 1)
    assert fitted.decode_step_s(7, 2100) == pytest.approx(0.4 * LATENCY.decode_step_s(7, 2100))


def test_steps_of_one_size_far_slower_than_the_model_is_fixed_are_a_slowdown() -> None:
    """16-token prompts at 3x the profile (a host whose cores other work takes): +150 ms a
    step is more than the model's whole fixed part of a step (51 ms), so it is a scale, and
    a 512-token step is priced 3x too."""
    steps = [StepSample(step=i, prompts=[16],
                        seconds=3.0 * LATENCY.prefill_latency_s(16, 256)) for i in range(1, 31)]
    calibrator = Calibrator(LATENCY)
    calibrator.observe("prefill-0", steps)
    found = calibrator.calibration()
    assert (found.prefill_fit, found.prefill) == ("scale", pytest.approx(3.0))


def test_a_slowdown_over_mostly_short_steps_is_a_scale() -> None:
    """The window a workload shift leaves: mostly 16-token prompts, every eighth 200 tokens,
    all 3x the profile (a CPU hog beside the stack). The short steps' medians fit a fixed
    +150 ms as well as a scale; beyond the model's 51 ms constant it is a slowdown."""
    rng = random.Random(3)
    steps = []
    for i in range(1, 41):
        n = 200 if i % 8 == 0 else 16
        seconds = 3.0 * LATENCY.prefill_latency_s(n, n * n) * rng.uniform(0.85, 1.15)
        steps.append(StepSample(step=i, prompts=[n], seconds=seconds))
    calibrator = Calibrator(LATENCY)
    calibrator.observe("prefill-0", steps)
    found = calibrator.calibration()
    assert (found.prefill_fit, found.prefill) == ("scale", pytest.approx(3.0, rel=0.05))


def test_live_steps_replace_the_profiles_contention_and_unloaded_ones_keep_it() -> None:
    """Steps timed live ran beside the host's other steps: a calibration of them carries
    that slowdown, so the profile's contention must not be counted on top; a calibration
    of unloaded requests (bench compare's) saw none of it and keeps it."""
    contended = dataclasses.replace(PROFILE, contention=Contention(decode_by_decode=1.4))
    calibrator = Calibrator(LATENCY)
    calibrator.observe("w-0", recorded_steps(1.0, 1.3))
    assert calibrator.calibration().apply(contended).contention.none
    unloaded = Calibration(prefill=1.1, decode=1.2)
    assert unloaded.apply(contended).contention == contended.contention


def back_to_back(start: float, step_s: float, n: int, first: int = 1,
                 prompt: int = 0) -> list[StepSample]:
    """`n` steps of `step_s` one after another from `start`, with their end times: prompts
    of `prompt` tokens, else batch-4 decodes at a 1,200-token context."""
    return [StepSample(step=first + k, prompts=[prompt] if prompt else [],
                       batch=0 if prompt else 4, context=0 if prompt else 1200,
                       seconds=step_s, ended=start + (k + 1) * step_s) for k in range(n)]


def disaggregated_steps() -> tuple[list[StepSample], list[StepSample], float]:
    """A 1P+1D stack on one host: decode alone at 1.1x the profile, then beside back-to-back
    prefills, each decode step 1.2x as long; then the prefill instance alone, as profiled.
    Also that longer step."""
    decode_s = 1.1 * LATENCY.decode_step_s(4, 1200)
    beside_s = 1.2 * decode_s
    prefill_s = LATENCY.prefill_latency_s(256, 256 * 256)
    decode = back_to_back(0.0, decode_s, 30) + back_to_back(20.0, beside_s, 80, 31)
    prefill = back_to_back(20.0, prefill_s, int(80 * beside_s / prefill_s) + 1, prompt=256)
    prefill += back_to_back(prefill[-1].ended + 1.0, prefill_s, 20, len(prefill) + 1, 256)
    return prefill, decode, beside_s


def heartbeats(calibrator: Calibrator, instances: dict[str, tuple[str, list[StepSample]]],
               every: float = 0.5) -> None:
    """Feed `instance -> (machine, steps)` to `calibrator` as the profiler hears them: a
    heartbeat of each instance every `every` seconds with its last 64 steps ended by then and
    its count of steps (numbered from 1)."""
    end = max(s.ended for _, steps in instances.values() for s in steps) + 3.0
    at = every
    while at <= end:
        for instance, (machine, steps) in instances.items():
            done = [s for s in steps if s.ended <= at]
            calibrator.observe(instance, done[-64:], machine=machine, heard_at=at,
                               steps=done[-1].step if done else 0)
        at += every


def test_steps_alone_give_the_level_and_steps_beside_a_neighbour_the_contention() -> None:
    """The profiler's calibration of a 1P+1D stack: the decode level from the decode steps
    that ran alone, the decode-beside-prefill factor from those that ran beside a prefill;
    the decode-beside-decode factor, which no step of this stack could show, stays the
    profile's, so a plan of two replicas decoding side by side is priced with it. The same
    steps from two machines never ran beside each other."""
    contended = dataclasses.replace(PROFILE, contention=Contention(
        decode_by_decode=1.6, decode_by_prefill=1.05, prefill_by_decode=1.1))
    prefill, decode, beside_s = disaggregated_steps()
    calibrator = Calibrator(LATENCY)
    heartbeats(calibrator, {"prefill-0": ("m", prefill), "decode-0": ("m", decode)})
    found = calibrator.calibration()
    assert (found.decode_basis, found.prefill_basis) == ("alone", "alone")
    assert found.decode == pytest.approx(1.1, rel=0.01)
    assert found.prefill == pytest.approx(1.0, rel=0.01)
    assert found.contention.keys() == {"decode_by_prefill", "prefill_by_decode"}
    # priced as they ran: the calibrated model's step times its contention
    priced = found.apply(contended)
    latency = priced.latency(1, 1)
    assert latency.decode_step_s(4, 1200) * latency.contention.factor(
        "decode", ["prefill"]) == pytest.approx(beside_s, rel=0.01)
    assert found.contention["decode_by_prefill"] == pytest.approx(1.2, rel=0.01)
    # the prefills beside the decodes took as long as alone: no slowdown measured
    assert found.contention["prefill_by_decode"] == pytest.approx(1.0)
    assert priced.contention == Contention(decode_by_decode=1.6, decode_by_prefill=found.contention[
        "decode_by_prefill"], prefill_by_decode=1.0)
    described = found.describe("decode")  # steps of one size: an offset fits
    assert described.startswith("1.10x the profile alone (+9 ms a step")
    assert described.endswith(f", {found.contention['decode_by_prefill']:.2f}x beside a prefill")
    # steps that do not say when they ran: the level of all of them, no contention on top
    blind = Calibrator(LATENCY)
    blind.observe("prefill-0", [s.model_copy(update={"ended": 0.0}) for s in prefill])
    blind.observe("decode-0", [s.model_copy(update={"ended": 0.0}) for s in decode])
    level = blind.calibration()
    assert level.decode_basis == "all" and level.decode > 1.1 * 1.05
    assert level.apply(contended).contention.none
    # on two machines: every step alone, the level of all of them
    apart = Calibrator(LATENCY)
    heartbeats(apart, {"prefill-0": ("m", prefill), "decode-0": ("n", decode)})
    assert apart.calibration().contention == {}
    assert apart.calibration().decode == pytest.approx(level.decode, rel=0.01)


def test_a_calibration_that_keeps_the_profiles_contention_prices_colocated_replicas_lower(
        ) -> None:
    """The planner weighing colocated replicas against the 1P+1D stack it runs (a profile
    whose decode steps take 1.8x beside another decoding device): on the steps' level alone,
    with the profile's decode-beside-decode factor and the decode-beside-prefill one
    measured, two replicas are priced well below the 1P+1D plan, which stays; on the same
    steps' average level with no contention (all the profiler could fit before the steps
    said when they ran) the replicas were priced as if they never met, and won."""
    contended = dataclasses.replace(PROFILE, contention=Contention(decode_by_decode=1.8))
    config = PlannerConfig(contended, SLO(5.0, 0.1), 0.9, 2,
                           modes=("disaggregated", "colocated"), batch_tokens=512,
                           max_running=64)
    window = WorkloadSummary(rate_rps=1.0, arrival_cv=1.0, prompt_tokens=[256] * 20,
                             output_tokens=[64] * 20)
    request = ReplanRequest(reasons=["first full window"], workload=window)
    prefill, decode, _ = disaggregated_steps()
    timed, blind = Calibrator(LATENCY), Calibrator(LATENCY)
    heartbeats(timed, {"prefill-0": ("m", prefill), "decode-0": ("m", decode)})
    for name, steps in (("prefill-0", prefill), ("decode-0", decode)):
        blind.observe(name, [s.model_copy(update={"ended": 0.0}) for s in steps])
    decisions = [decide(request, None, config, now=1.0, calibration=c.calibration())
                 for c in (timed, blind)]
    assert decisions[0] is not None and decisions[1] is not None
    (with_contention, without) = ({c.mode: c.goodput_rps for c in d.candidates}
                                  for d in decisions)
    assert with_contention["colocated"] < 0.5 * without["colocated"]
    assert with_contention["colocated"] < 0.5 * with_contention["disaggregated"]
    assert decisions[0].plan.mode == "disaggregated"
    assert decisions[1].plan.mode in ("colocated", "chunked")


def test_a_moment_is_placed_only_where_every_neighbour_is_known_then() -> None:
    """What the machine's other instances ran at a moment, as their heartbeats tell it: a
    step, idle between steps numbered one after the other, not known past an instance's last
    step until a heartbeat counted no step since (less a margin for a step still running),
    nor over steps that ran unpriced; idle once an instance stopped heartbeating."""
    def step(n: int, start: float, end: float) -> StepSample:
        return StepSample(step=n, batch=1, context=100, seconds=end - start, ended=end)

    timeline = Timeline()
    timeline.add("a", "m", [step(i, i - 1.0, float(i)) for i in range(1, 21)])  # busy 0-20
    timeline.add("b", "m", [step(1, 0.5, 1.5), step(2, 2.0, 2.5)])
    timeline.add("c", "another machine", [])  # runs nothing priced, elsewhere: no matter
    assert timeline.beside("a", 1.0) == ["decode"]
    assert timeline.beside("a", 1.75) == []  # between b's steps 1 and 2
    assert timeline.beside("b", 2.2) == ["decode"]
    assert timeline.beside("a", 3.0) is None  # b may be mid-step
    timeline.heard("b", 5.0, 2)  # no step since its second: idle until 5.0 - 1.5 x 1.0
    assert timeline.beside("a", 2.4) == ["decode"] and timeline.beside("a", 3.0) == []
    assert timeline.beside("a", 4.0) is None
    # its third step was not priced: it ran somewhere after its second (not necessarily
    # within the margin: an unpriced step may be longer than any priced one)
    timeline.add("b", "m", [step(4, 6.0, 6.5)])
    assert timeline.beside("a", 3.0) is None and timeline.beside("a", 4.5) is None
    assert timeline.beside("a", 6.2) == ["decode"]
    timeline.heard("b", 7.0, 4)
    assert timeline.beside("a", 9.5) is None
    assert timeline.beside("a", 12.5) == []  # 5 s after its last heartbeat: gone
    # a heartbeat that says whether a step is running needs no margin
    timeline.add("b", "m", [step(5, 13.0, 13.5)])
    timeline.heard("b", 14.0, 5, busy_since=13.8)  # one started at 13.8
    assert timeline.beside("a", 13.7) == [] and timeline.beside("a", 13.9) is None
    timeline.heard("b", 15.0, 5, busy_since=0.0)  # none running: idle since 13.5
    assert timeline.beside("a", 14.9) == []
    # an instance whose steps are not priced makes its machine's moments unknown
    timeline.add("d", "m", [])
    assert timeline.beside("a", 1.0) is None
    timeline.forget("d")
    assert timeline.beside("a", 1.0) == ["decode"]
    # a record forgotten (a restart, 10 minutes silent) leaves what ran up to the last
    # moment it told of unknown, not idle; and its own steps placed nowhere
    timeline.forget("b")
    assert timeline.beside("a", 1.0) is None and timeline.beside("a", 14.9) is None
    assert timeline.beside("a", 15.5) == [] and timeline.beside("b", 16.0) is None


def test_a_calibration_saved_before_bases_is_priced_as_it_was() -> None:
    """Saved by a profiler before phases said what they were fitted on (Redis, a plan's
    record): fitted on all the steps, no contention on top; an unloaded one keeps it."""
    contended = Contention(decode_by_decode=1.5)
    old = Calibration.model_validate_json(
        '{"prefill": 1.2, "decode": 1.1, "prefill_steps": 40, "decode_steps": 80}')
    assert (old.prefill_basis, old.decode_basis) == ("all", "all")
    assert old.contention_over(contended).none
    assert Calibration(prefill=1.2).contention_over(contended) == contended


def test_the_planner_plans_again_when_the_priced_contention_moves() -> None:
    """A factor measured as the profile has it changes no price: no replan; fitted on all
    steps instead of the steps alone (so the profile's 1.8 gives way to none), it does."""
    profiled = Contention(decode_by_decode=1.8)
    alone = Calibration(prefill_steps=40, decode_steps=80, prefill_basis="alone",
                        decode_basis="alone")
    same = alone.model_copy(update={"contention": {"decode_by_decode": 1.8}})
    assert not same.differs(alone, 1.2, profiled)
    assert same.differs(alone, 1.2)  # against a profile without contention it moved
    blended = alone.model_copy(update={"decode_basis": "all"})
    reason = replan_reason(blended, alone, 1.2, 10, profiled)
    assert reason is not None and "were 1.00x the profile alone" in reason


def test_a_worker_restarted_under_its_name_starts_a_new_record() -> None:
    """Counting from 0 again, a worker's new steps are taken (not dropped as seen), and its
    old record says nothing of its new life."""
    calibrator = Calibrator(LATENCY)
    first = back_to_back(0.0, 0.1, 30)
    calibrator.observe("decode-0", first, machine="m", heard_at=3.5, steps=30, busy_since=0.0)
    again = back_to_back(10.0, 0.1, 5)
    assert calibrator.observe("decode-0", again, machine="m", heard_at=10.6, steps=5,
                              busy_since=0.0) == 5
    assert calibrator.timeline.running("decode-0", 5.0) is None  # before its new record
    assert calibrator.timeline.running("decode-0", 10.25) == "decode"


def test_each_phase_is_calibrated_on_its_steps_of_the_last_two_minutes() -> None:
    """Both phases over the same span of time (by steps, a window of 200 decode steps held
    4 s of two busy replicas, and their contention swung 1.04-1.73 from one to the next),
    at most `window` steps of each."""
    calibrator = Calibrator(LATENCY)
    calibrator.observe("decode-0", back_to_back(0.0, 0.1, 2000))  # 200 s
    kept = calibrator.steps["decode"]
    assert 1199 <= len(kept) <= 1201 and kept[-1].ended == pytest.approx(200.0)
    assert kept[0].ended >= 200.0 - calibrator.window_s
    capped = Calibrator(LATENCY, window=500)
    capped.observe("decode-0", back_to_back(0.0, 0.1, 2000))
    assert len(capped.steps["decode"]) == 500


def test_a_window_of_prefills_minutes_long_is_placed_beside_a_busy_decode_instance() -> None:
    """A window of prefills spans minutes where a decode instance beside them runs 50 steps
    a second: each prefill is placed once its neighbours' heartbeats have told, and the
    timeline keeps only what steps yet to be placed need (cut by count, the decode
    instance's record reached back 80-120 s and the older prefills were placed nowhere)."""
    decode = back_to_back(0.0, 0.02, 10_000)  # 200 s
    prefill = [s for k in range(20)
               for s in back_to_back(10.0 * k + 1.0, 0.5, 1, first=k + 1, prompt=256)]
    calibrator = Calibrator(LATENCY, window=200, window_s=300.0)  # a record cut at 8,000
    heartbeats(calibrator, {"decode-0": ("m", decode), "prefill-0": ("m", prefill)})
    placed = calibrator.placed("prefill")
    assert len(placed) == 20
    assert all(moments == (("decode",),) * MOMENTS for _, moments in placed)
    late_s = calibrator.late_s
    assert calibrator.timeline.held() <= late_s / 0.02 + 2 * 20  # the last minute's, about


Ran = tuple[float, float, StepSample | None]  # start, end, the step (None: unpriced)


def hear(calibrator: Calibrator, ran: dict[str, list[Ran]], start: float, end: float) -> None:
    """The profiler hearing `ran` from `start` to `end`: a heartbeat of each instance every
    0.5 s with its last 64 priced steps, its count of steps (unpriced ones too) and since
    when one runs."""
    at = start
    while at <= end:
        for instance, steps in ran.items():
            done = [r for r in steps if r[1] <= at]
            busy = next((r[0] for r in steps if r[0] <= at < r[1]), 0.0)
            priced = [r[2] for r in done if r[2] is not None][-64:]
            calibrator.observe(instance, priced, machine="m", heard_at=at, steps=len(done),
                               busy_since=busy)
        at += 0.5


def ran(steps: list[StepSample]) -> list[Ran]:
    return [(s.ended - s.seconds, s.ended, s) for s in steps]


def test_steps_are_placed_for_good_only_once_every_neighbour_has_told() -> None:
    """A profiler started while the workers run hears one before the other: the first's
    steps wait for its neighbour's record (placed alone at once, they would have read
    alone for the whole window); steps beside a neighbour's unpriced steps (chunked) are
    placed nowhere for good, not alone once its record is trimmed; and a step beside the
    first step a neighbour ran after a long lull is placed beside it."""
    decode = ran(back_to_back(0.0, 0.05, 8000))  # 400 s
    prefill = ran([s for k in range(40)
                   for s in back_to_back(10.0 * k, 2.0, 1, first=k + 1, prompt=256)])
    late = Calibrator(LATENCY)
    hear(late, {"prefill-0": prefill, "decode-0": decode}, 300.0, 310.0)
    placed = {round(t.ended): moments for t, moments in late.placed("prefill")}
    # the last two minutes; before the decode instance's 64 steps heard, what ran beside
    # is not known
    assert set(placed) == {10 * k + 2 for k in range(19, 31)}
    assert placed.pop(302) == (("decode",),) * MOMENTS
    assert set(placed.values()) == {None}

    mixed = ran(back_to_back(0.0, 0.1, 1))
    mixed += [(0.1 + 0.2 * k, 0.3 + 0.2 * k, None) for k in range(49)]  # to 9.9 s
    mixed += ran(back_to_back(9.9, 0.2, 1, first=51))
    beside_mixed = Calibrator(LATENCY)
    hear(beside_mixed, {"a": ran(back_to_back(0.0, 0.05, 2000)), "b": mixed}, 0.5, 100.5)
    unknown = [moments for t, moments in beside_mixed.placed("decode")
               if t.instance == "a" and 0.2 < t.ended < 9.8]
    assert len(unknown) == 191 and set(unknown) == {None}

    lull = [(0.0, 0.1, back_to_back(0.0, 0.1, 1, prompt=256)[0]),
            (100.03, 101.03, back_to_back(100.03, 1.0, 1, first=2, prompt=256)[0])]
    after_lull = Calibrator(LATENCY)
    hear(after_lull, {"a": ran(back_to_back(0.0, 0.05, 2400)), "b": lull}, 0.5, 120.0)
    straddling = [moments for t, moments in after_lull.placed("decode")
                  if t.ended - t.seconds < 100.03 < t.ended]
    assert straddling == [((),) * 5 + (("prefill",),) * 3]

    # a neighbour's first step, 20 s long: the steps beside it wait for it to be told
    long = Calibrator(LATENCY)
    hear(long, {"a": ran(back_to_back(0.0, 0.05, 1600)),
                "b": ran(back_to_back(50.0, 20.0, 1, prompt=256))}, 0.5, 80.0)
    beside_long = [moments for t, moments in long.placed("decode")
                   if t.ended - t.seconds >= 50.0 and t.ended <= 70.0]
    assert len(beside_long) >= 398 and set(beside_long) == {(("prefill",),) * MOMENTS}


def test_a_machine_gone_quiet_leaves_the_window_with_the_rest() -> None:
    """Steps age by the newest step heard from any machine: one machine's last steps do
    not stay in the window (nor hold the others' there) once it stops."""
    calibrator = Calibrator(LATENCY)
    for k in range(600):
        at = float(k + 1)
        if k < 30:
            calibrator.observe("gone-0", back_to_back(float(k), 1.0, 1, first=k + 1,
                                                      prompt=64), machine="m1",
                               heard_at=at, steps=k + 1)
        calibrator.observe("p-0", back_to_back(float(k), 1.0, 1, first=k + 1, prompt=64),
                           machine="m0", heard_at=at, steps=k + 1)
    kept = calibrator.steps["prefill"]
    assert {t.instance for t in kept} == {"p-0"}
    assert kept[-1].ended - kept[0].ended <= calibrator.window_s


def test_a_run_recorded_whole_is_known_from_its_first_step_however_long() -> None:
    """bench compare's runs: every step of the run in the record, past any trimming."""
    steps = {"a": back_to_back(0.0, 0.01, 9000),
             "b": back_to_back(1.0, 0.01, 20)}
    placed = calibrator_of(steps, LATENCY).placed("decode")
    b_steps = [beside for t, beside in placed if t.instance == "b"]
    assert b_steps == [(("decode",),) * MOMENTS] * 20


@pytest.mark.parametrize(("beside", "count"), [(1.2, 40), (1.5, 40), (1.2, MEAN_FROM - 1)])
def test_a_level_the_steps_beside_a_neighbour_beat_is_fitted_on_them_all(
        beside: float, count: int) -> None:
    """A prefill instance near capacity: 4 of its steps ran alone, at 1.3x the profile,
    then `count` beside back-to-back decodes at `beside`x. 40 at 1.2x ran faster in all than
    the level of the 4 alone prices them; a neighbour does not speed a step up, so the 4 read
    high by chance: the 40 ran as if alone, and the level a step alone runs at is fitted on
    all 44 (their total), with no slowdown beside a decode. At 1.5x the 4 set the level and
    the neighbour's slowdown is priced over it. Fewer than `MEAN_FROM` at 1.2x say only that
    the median one was no slower (the robust fit's): the 4 keep the level."""
    step_s = LATENCY.prefill_latency_s(512, 512 * 512)
    prefills = back_to_back(0.0, 1.3 * step_s, 4, prompt=512)
    start = prefills[-1].ended + 1.0
    prefills += back_to_back(start, beside * step_s, count, first=5, prompt=512)
    decode_s = LATENCY.decode_step_s(4, 1200)
    decodes = back_to_back(start - decode_s, decode_s,
                           int(count * beside * step_s / decode_s) + 3)
    found = calibrator_of({"prefill-0": prefills, "decode-0": decodes}, LATENCY).calibration()
    if beside < 1.3 and count >= MEAN_FROM:
        assert found.prefill == pytest.approx((4 * 1.3 + 40 * beside) / 44, rel=1e-3)
    else:
        assert found.prefill == pytest.approx(1.3, rel=1e-3)
    assert (found.contention["prefill_by_decode"] > 1.1) == (beside > 1.3)
    assert found.prefill_basis == "alone"


def test_a_neighbour_beside_part_of_a_step_is_priced_for_that_part() -> None:
    """A prefill instance's steps: 12 alone at 1.2x the profile, then 12 whose second half
    ran beside a decoding neighbour, 1.5x slower while it did (the simulator's processor
    sharing: a step of W seconds alone takes W/2 alone-paced, then the rest at 1/1.5 the
    pace). The measured factor is the 1.5 it ran at beside the neighbour, not the 1.2x the
    whole step took over its time alone (what placing it by its midpoint measured)."""
    alone_s = 1.2 * LATENCY.prefill_latency_s(512, 512 * 512)
    took_s = 1.2 * alone_s
    assert took_s / 2 + took_s / 2 / 1.5 == pytest.approx(alone_s)  # its work, paced so
    prefills = [s.model_copy(update={"seconds": alone_s})  # a gap after each: idle
                for s in back_to_back(0.0, 2 * alone_s, 12, prompt=512)]
    start, decodes = 30.0, []
    for k in range(12):
        prefills.append(StepSample(step=13 + k, prompts=[512], seconds=took_s,
                                   ended=start + took_s))
        half = took_s / 2 / 10
        decodes += back_to_back(start + took_s / 2, half, 10, first=1 + 10 * k)
        start += 2 * took_s
    calibrator = calibrator_of({"prefill-0": prefills, "decode-0": decodes}, LATENCY)
    placed = calibrator.placed("prefill")
    half = ((),) * (MOMENTS // 2) + (("decode",),) * (MOMENTS // 2)
    assert [moments for _, moments in placed] == [ALONE] * 12 + [half] * 12
    found = calibrator.calibration()
    assert found.prefill_basis == "alone"
    assert found.prefill == pytest.approx(1.2)
    assert found.contention["prefill_by_decode"] == pytest.approx(1.5)


@pytest.mark.parametrize("beside", [MEAN_FROM - 1, 100])
def test_a_neighbours_slowdown_is_priced_at_its_mean_so_steps_add_up(beside: int) -> None:
    """A decode instance's steps: 40 alone at 1.1x the profile, then `beside` of them beside
    back-to-back prefills, 1.2x slower than alone, but one in five of them 2.0x (a tail, as a
    neighbour's slowdown has). The robust fit finds the 1.2x most steps ran at; a request's
    time is its steps' sum, so over `MEAN_FROM` steps or more the factor is set where the
    steps beside the prefills, priced as the simulator paces them, take what they took.
    Fewer keep the robust fit: one slow spell of a few steps would move the mean."""
    decode_s = 1.1 * LATENCY.decode_step_s(4, 1200)
    took = [decode_s * (2.0 if k % 5 == 0 else 1.2) for k in range(beside)]
    found = decoding_beside_prefills(decode_s, took)
    assert found.decode_basis == "alone" and found.decode == pytest.approx(1.1, rel=0.01)
    priced_s = priced_beside_a_prefill(found)
    if beside >= MEAN_FROM:
        assert beside * priced_s == pytest.approx(sum(took), rel=0.01)
    else:  # near the 1.2x most ran at (the soft loss still hears the tail a little)
        assert priced_s == pytest.approx(1.2 * decode_s, rel=0.02)
        assert beside * priced_s < 0.93 * sum(took)


def test_a_slowdown_only_the_mean_shows_is_priced_too() -> None:
    """A decode instance's steps beside back-to-back prefills: four in five 2% faster than
    its 40 alone, one in five 1.3x slower (mean 1.04x). The robust fit finds no slowdown (most
    ran at least as fast); the mean is raised from none all the same. No step met another
    decode, so that phase's factor (which nothing fits) neither bounds the prefill's nor is
    given."""
    decode_s = 1.1 * LATENCY.decode_step_s(4, 1200)
    took = [decode_s * (1.3 if k % 5 == 0 else 0.98) for k in range(100)]
    found = decoding_beside_prefills(decode_s, took)
    assert found.decode == pytest.approx(1.1, rel=0.01)
    assert "decode_by_decode" not in found.contention
    assert 100 * priced_beside_a_prefill(found) == pytest.approx(sum(took), rel=0.01)


def test_a_phase_met_too_briefly_is_priced_at_the_profiles_factor_where_steps_add_up() -> None:
    """A decode instance's 40 steps alone at 1.1x the profile, then 100 beside back-to-back
    prefills at 1.2x their time alone; two of those also beside another decode instance's
    two steps, at 1.3x (the four steps met a decode for under half of `min_steps` steps'
    time: that factor is not given, and the simulator prices it at the profile's 1.6). The
    factor beside a prefill is set where the 102 steps add up as the simulator prices them,
    the decodes' slowdown at the profile's: priced at none they came 2.0% over, and at the
    robust fit alone (no rescale) 1.6% over."""
    contended = dataclasses.replace(PROFILE, contention=Contention(decode_by_decode=1.6))
    latency = contended.latency(1, 1)
    decode_s = 1.1 * latency.decode_step_s(4, 1200)
    took = [decode_s * (1.3 if k in (50, 51) else 1.2) for k in range(100)]
    decode = back_to_back(0.0, decode_s, 40)
    other: list[StepSample] = []
    end = 20.0
    for k, seconds in enumerate(took):
        end += seconds
        decode.append(StepSample(step=41 + k, batch=4, context=1200, seconds=seconds,
                                 ended=end))
        if k in (50, 51):  # the other decode's step alongside, start to end
            other.append(StepSample(step=k - 49, batch=4, context=1200, seconds=seconds,
                                    ended=end))
    prefill_s = latency.prefill_latency_s(256, 256 * 256)
    prefill = back_to_back(20.0 - prefill_s, prefill_s, int((end - 20.0) / prefill_s) + 3,
                           prompt=256)
    found = calibrator_of({"prefill-0": prefill, "decode-0": decode, "decode-1": other},
                          latency).calibration()
    assert found.decode_basis == "alone" and found.decode == pytest.approx(1.1, rel=0.01)
    assert "decode_by_decode" not in found.contention
    priced = found.apply(contended).latency(1, 1)
    step_s = priced.decode_step_s(4, 1200)
    priced_s = 98 * step_s * priced.contention.factor("decode", ["prefill"]) + \
        4 * step_s * priced.contention.factor("decode", ["prefill", "decode"])
    assert priced_s == pytest.approx(sum(took) + sum(s.seconds for s in other), rel=1e-3)


def decoding_beside_prefills(decode_s: float, took: list[float]) -> Calibration:
    """The calibration of a decode instance's 40 steps alone of `decode_s` (batch 4,
    context 1,200), then steps that `took` so long beside back-to-back 256-token prefills."""
    decode = back_to_back(0.0, decode_s, 40)
    end = 20.0
    for k, seconds in enumerate(took):
        end += seconds
        decode.append(StepSample(step=41 + k, batch=4, context=1200, seconds=seconds,
                                 ended=end))
    prefill_s = LATENCY.prefill_latency_s(256, 256 * 256)
    prefill = back_to_back(20.0 - prefill_s, prefill_s, int((end - 20.0) / prefill_s) + 3,
                           prompt=256)
    return calibrator_of({"prefill-0": prefill, "decode-0": decode}, LATENCY).calibration()


def priced_beside_a_prefill(found: Calibration) -> float:
    """What `found` prices a decode step of batch 4 at a 1,200-token context at, beside a
    prefill all along."""
    latency = found.apply(PROFILE).latency(1, 1)
    return latency.decode_step_s(4, 1200) * latency.contention.factor("decode", ["prefill"])


def test_steps_that_met_both_phases_give_both_factors() -> None:
    """Three instances on one machine. The measured prefill instance's steps: 12 alone at
    1.2x the profile, then 12 that ran beside a decoding neighbour for a share a of their
    time (1.4x slower meanwhile) and beside another prefill for the rest (1.5x): a quarter
    then three quarters, by turns. None of its steps met one phase alone (the other
    prefill's steps met only its prefills: no decode), yet both factors are found, fitted
    together on what each step took."""
    alone_s = 1.2 * LATENCY.prefill_latency_s(512, 512 * 512)
    measured = [s.model_copy(update={"seconds": alone_s})
                for s in back_to_back(0.0, 2 * alone_s, 12, prompt=512)]
    decodes: list[StepSample] = []
    others: list[StepSample] = []
    start = 30.0
    for k in range(12):
        a = 0.25 if k % 2 else 0.75
        took_s = alone_s / (a / 1.4 + (1 - a) / 1.5)
        measured.append(StepSample(step=13 + k, prompts=[512], seconds=took_s,
                                   ended=start + took_s))
        decodes += back_to_back(start, a * took_s / 5, 5, first=1 + 5 * k)
        # the other prefill ran its step beside this one all along: 1.5x its time alone
        other_s = (1 - a) * took_s
        prompt = next(n for n in range(1, 4096)
                      if 1.2 * 1.5 * LATENCY.prefill_latency_s(n, n * n) >= other_s)
        others.append(StepSample(step=1 + k, prompts=[prompt], seconds=other_s,
                                 ended=start + took_s))
        start += 2 * took_s
    calibrator = calibrator_of({"prefill-0": measured, "decode-0": decodes,
                                "prefill-1": others}, LATENCY)
    mixed = [moments for t, moments in calibrator.placed("prefill")
             if t.instance == "prefill-0" and moments not in (None, ALONE)]
    assert len(mixed) == 12 and all(set(moments) == {("decode",), ("prefill",)}
                                    for moments in mixed)
    found = calibrator.calibration()
    assert found.prefill_basis == "alone" and found.prefill == pytest.approx(1.2)
    # (the other prefill's steps priced to a whole token)
    assert found.contention["prefill_by_decode"] == pytest.approx(1.4, rel=0.01)
    assert found.contention["prefill_by_prefill"] == pytest.approx(1.5, rel=0.01)


def test_a_fixed_time_a_step_suits_every_model_the_correction_prices() -> None:
    """Prefill steps 5 ms faster than the profile a step, of one size: a fixed time fits
    them (within the profile's own constant); where a prefill profile whose constant is
    smaller than 5 ms also takes the correction (`also`, the profiler's with
    DS_PLANNER_PREFILL_PROFILE), a fixed time would price its small prefills below zero:
    the scale then."""
    big = dataclasses.replace(LATENCY, coefficients=dataclasses.replace(
        LATENCY.coefficients, prefill=(20.0, *LATENCY.coefficients.prefill[1:])))
    small = dataclasses.replace(big, coefficients=dataclasses.replace(
        big.coefficients, prefill=(2.0, *big.coefficients.prefill[1:])))
    steps = [StepSample(step=i, prompts=[200], seconds=big.prefill_latency_s(200, 200 ** 2)
                        - 0.005) for i in range(1, 31)]
    fitted = []
    for also in ((), (small,)):
        calibrator = Calibrator(big, also=also)
        calibrator.observe("prefill-0", steps)
        fitted.append(calibrator.calibration().prefill_fit)
    assert fitted == ["offset", "scale"]


def test_a_chunk_is_predicted_with_its_cached_tokens_at_their_own_cost() -> None:
    """A step of 128 new tokens over 512 cached is priced with d where the profile measured
    it (what the calibrator compares the step's time with), at c where it did not."""
    co = PROFILE.by_tp[1]
    step = StepSample(step=1, prompts=[128], done=[512], seconds=0.5)
    for d in (None, 1.2e-3):
        latency = LatencyModel(dataclasses.replace(co, prefill_cached=d))
        a, b, c = co.prefill
        expected = a + b * 128 + c * 128**2 + (c if d is None else d) * 128 * 512
        assert predicted_s(latency, step) == pytest.approx(expected / 1e3)


def test_a_prompt_step_of_a_few_tokens_says_nothing_of_the_prefill_level() -> None:
    """A chunked prompt's tail (2 tokens left by a 510-token chunk beside 2 decodes) reads
    the weights as a decode step does, which the prefill model underprices (~2x on the Zen
    4). However many such steps there are, the level comes from the prompt steps the
    profile measured the like of (16 tokens and more)."""
    steps = []
    for step in range(1, 41):
        if step % 4 == 0:  # a whole prompt, 10% slower than profiled
            seconds = 1.1 * LATENCY.prefill_latency_s(512, 512**2)
            steps.append(StepSample(step=step, prompts=[512], seconds=seconds))
        else:  # a tail, twice its price
            tail = StepSample(step=step, prompts=[2], done=[510], batch=2, context=1028,
                              seconds=0.0)
            steps.append(tail.model_copy(update={"seconds": 2.0 * predicted_s(LATENCY, tail)}))
    calibrator = Calibrator(LATENCY)
    calibrator.observe("colocated-0", steps)
    found = calibrator.calibration()
    assert found.prefill_steps == 40  # all heard, ten fitted on
    assert found.prefill == pytest.approx(1.1, rel=0.01)


def test_a_workload_of_short_prompts_is_calibrated_on_them() -> None:
    """Where the prompt steps of 16 tokens or more are too few for a level, the short ones
    are fitted on: a workload of 8-token prompts 1.5x as slow as profiled reads 1.5x."""
    steps = [StepSample(step=i, prompts=[8], seconds=1.5 * LATENCY.prefill_latency_s(8, 64))
             for i in range(1, 31)]
    calibrator = Calibrator(LATENCY)
    calibrator.observe("prefill-0", steps)
    found = calibrator.calibration()
    assert found.prefill_basis != "profile"
    assert found.prefill == pytest.approx(1.5, rel=0.01)
