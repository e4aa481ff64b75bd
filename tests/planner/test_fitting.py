import dataclasses
from pathlib import Path

import pytest

from services.planner.fitting import (
    CachedPoint,
    DecodePoint,
    PrefillPoint,
    cached_report,
    fit,
    fit_cached,
    fit_decode,
    fit_phase,
    interior_held_out,
    relative_errors,
)
from services.planner.latency import LatencyModel, PhaseCoefficients
from services.planner.profiles import (
    load_profile,
    measured_elsewhere,
    saturation_length,
    save_profile,
    shipped_cpu_profile,
    with_prefill_of,
)
from services.planner.profiling import Grid


def test_fit_recovers_known_coefficients() -> None:
    truth = (12.0, 0.08, 3e-5)
    points = [PrefillPoint((n,) * b, truth[0] + truth[1] * n * b + truth[2] * n * n * b)
              for n in (16, 64, 256, 1024) for b in (1, 2, 4)]
    assert fit(points) == pytest.approx(truth, rel=1e-6)
    decode = [DecodePoint(b, b * c, 5.0 + 0.001 * b * c + 0.2 * b)
              for b in (1, 8, 32) for c in (64, 512)]
    co, report = fit_phase(points, decode)
    assert co.decode_small == pytest.approx((5.0, 0.001, 0.2), rel=1e-6)
    assert report["prefill_heldout_median_rel_err"] < 1e-6


def test_relative_errors_measure_misfit() -> None:
    points = [PrefillPoint((100,), 20.0)]
    assert relative_errors((10.0, 0.05, 0.0), points) == pytest.approx([0.25])


def test_saturation_length_is_where_throughput_levels_off() -> None:
    # a fixed 20 ms cost amortised over tokens at 0.1 ms each: 90% of the best rate is
    # reached when 20/n <= 0.1/9 ... well before the longest prompt
    co = PhaseCoefficients((20.0, 0.1, 0.0), (1, 0, 0), (1, 0, 0))
    l_m = saturation_length(co, share=0.9, limit=8192)
    rate = l_m / (20 + 0.1 * l_m)
    assert rate >= 0.9 * 8192 / (20 + 0.1 * 8192)
    assert (l_m - 16) / (20 + 0.1 * (l_m - 16)) < 0.9 * 8192 / (20 + 0.1 * 8192)


def test_held_out_points_are_interior_and_extremes_stay_in_the_fit() -> None:
    points = [DecodePoint(b, b * 64, float(b)) for b in (1, 2, 4, 8, 16, 32)]
    kept, held = interior_held_out(points, lambda p: p.batch)
    assert [p.batch for p in held] == [4, 16]
    assert {1, 32} <= {p.batch for p in kept} and not set(held) & set(kept)


def two_regime_points(drift: dict[int, float]) -> list[DecodePoint]:
    """Decode steps of a small-batch regime (B < 8) and a large one sharing attention's
    cost per context token (0.009 ms), each context's steps slowed by `drift`."""
    small, large = (30.0, 0.009, 16.0), (60.0, 0.009, 4.0)
    return [DecodePoint(b, b * c, (t[0] + t[1] * b * c + t[2] * b) * drift[c])
            for c in drift for b in (1, 2, 4, 8, 16, 32)
            for t in [small if b < 8 else large]]


def test_decode_regimes_share_the_cost_per_context_token() -> None:
    small, large, threshold = fit_decode(two_regime_points({64: 1.0, 256: 1.0, 512: 1.0}))
    assert threshold == 8
    assert small == pytest.approx((30.0, 0.009, 16.0), rel=1e-6)
    assert large == pytest.approx((60.0, 0.009, 4.0), rel=1e-6)
    # the host got 9% quieter over the run: fitted alone, the small batches' few ms of
    # attention drown (0.0027 ms a token); shared, the large batches carry it
    small, large, _ = fit_decode(two_regime_points({64: 1.05, 256: 1.0, 512: 0.96}))
    assert small[1] == large[1] > 0.6 * 0.009


def test_a_profile_carries_its_models_shape(tmp_path: Path) -> None:
    """A profile of a model the planner does not know by name (a Hugging Face directory
    profiled here) loads with the model's shape from the file."""
    shipped = load_profile(shipped_cpu_profile(1))
    mine = dataclasses.replace(shipped, model=dataclasses.replace(
        shipped.model, name="Qwen3-0.6B", num_layers=28, kv_size=1024))
    save_profile(mine, tmp_path / "p.json")
    again = load_profile(tmp_path / "p.json")
    assert again.model == mine.model and again.by_tp == shipped.by_tp


def test_a_profile_says_which_cpu_it_was_measured_on(tmp_path: Path) -> None:
    """The planner and `bench compare` warn when a CPU profile comes from another CPU (or
    does not say): the same engine's steps differ 2-3x between hosts."""
    shipped = load_profile(shipped_cpu_profile(1))
    here = "AMD EPYC (family 23 model 1, avx2)"
    mine = dataclasses.replace(shipped, host=here)
    save_profile(mine, tmp_path / "p.json")
    again = load_profile(tmp_path / "p.json")
    assert again.host == here
    assert measured_elsewhere(again, here) is None
    elsewhere = measured_elsewhere(again, "Intel Xeon (family 6 model 143, avx512)")
    assert elsewhere is not None and here in elsewhere
    unsaid = measured_elsewhere(dataclasses.replace(shipped, host=""), here)
    assert unsaid is not None and "does not say" in unsaid
    gpu = dataclasses.replace(shipped, device="NVIDIA H100 80GB HBM3", host="")
    assert measured_elsewhere(gpu, here) is None  # a GPU profile names its device already


def test_the_shipped_profile_is_the_one_measured_on_this_cpu_where_one_ships() -> None:
    """With no profile named, the planner, the profiler and `bench compare --simulate` take
    the shipped float32 profile whose `host` is this CPU, else the generic one for the
    threads; a profile measured in another dtype (a prefill instance's, for `distserve plan
    --prefill-profile`) is never taken for it."""
    generic = shipped_cpu_profile(1)
    assert generic.name == "smollm2-135m-cpu-1thread.json"
    assert shipped_cpu_profile(2).name == "smollm2-135m-cpu-2threads.json"
    others = 0
    for path in generic.parent.glob("smollm2-135m-cpu-1thread-*.json"):
        profile = load_profile(path)
        assert profile.host, f"{path.name} must say which CPU it was measured on"
        if profile.dtype in ("", "float32"):
            assert shipped_cpu_profile(1, profile.host) == path
        else:
            others += 1
            assert path.stem.endswith(profile.dtype)
            float32 = load_profile(shipped_cpu_profile(1, profile.host))
            assert float32.host == profile.host and float32.dtype in ("", "float32")
        assert shipped_cpu_profile(2, profile.host).name == "smollm2-135m-cpu-2threads.json"
    assert others, "a bfloat16 profile ships beside its host's float32 one"
    zen1 = "AMD EPYC (family 23 model 1, avx2)"
    assert shipped_cpu_profile(1, zen1).name == "smollm2-135m-cpu-1thread-amd-epyc-zen1.json"
    assert shipped_cpu_profile(1, "Some CPU (family 1 model 1, baseline)") == generic
    assert shipped_cpu_profile(1, "") == generic


def test_the_cost_of_cached_tokens_is_fitted_on_what_chunks_add_to_a_whole_prompt() -> None:
    """d comes from each chunk's time beyond a whole prompt of its length, so a whole-prompt
    fit that misprices that length (here by +20 ms) leaves it alone; the model priced with d
    fits the chunks, priced at c (as before d was measured) it does not."""
    d, whole = 1.2e-3, {128: 320.0, 256: 640.0}
    points = [CachedPoint(n, k, whole[n] + d * n * k, whole[n])
              for n, k in ((128, 256), (128, 896), (256, 768))]
    assert fit_cached(points) == pytest.approx(d, rel=1e-9)
    co = PhaseCoefficients((20.0, 2.5, 2.4e-4), (1, 0, 0), (1, 0, 0), prefill_cached=d)
    report = cached_report(co, points)
    assert report["prefill_cached_points"] == 3
    assert report["prefill_cached_max_rel_err"] < 0.1
    assert report["prefill_cached_at_c_max_rel_err"] > 0.15
    # chunks no slower than whole prompts (noise) leave d unmeasured, priced at c
    assert fit_cached([CachedPoint(128, 256, 300.0, 320.0)]) is None


def test_cached_tokens_are_priced_at_d_where_measured_at_c_where_not(tmp_path: Path) -> None:
    old = PhaseCoefficients((10.0, 2.0, 1e-4), (1, 0, 0), (1, 0, 0))
    new = dataclasses.replace(old, prefill_cached=1e-3)
    # 128 new tokens over 512 cached: 10 + 256 + 1.64 + d * 65,536
    assert LatencyModel(old).prefill_ms(128, 128**2, 128 * 512) == pytest.approx(
        10 + 256 + 1.6384 + 6.5536)
    assert LatencyModel(new).prefill_ms(128, 128**2, 128 * 512) == pytest.approx(
        10 + 256 + 1.6384 + 65.536)
    assert LatencyModel(new).prefill_ms(128, 128**2) == LatencyModel(old).prefill_ms(
        128, 128**2)  # a whole prompt is what it was
    assert new.scaled(2.0).prefill_cached == pytest.approx(5e-4)
    assert new.slowed(1.5, 1.0).prefill_cached == pytest.approx(1.5e-3)
    assert old.scaled(2.0).prefill_cached is None
    # a profile keeps d, and one without it reads as before
    profile = load_profile(shipped_cpu_profile(1))
    path = tmp_path / "p.json"
    save_profile(dataclasses.replace(profile, by_tp={1: new}), path)
    assert load_profile(path).by_tp[1].prefill_cached == 1e-3
    save_profile(dataclasses.replace(profile, by_tp={1: old}), path)
    assert "prefill_cached" not in path.read_text()
    assert load_profile(path).by_tp[1].prefill_cached is None
    # a measured pipeline (which times no chunks) takes its tp's d; a prefill profile's d
    # prices the prefill instances
    piped = dataclasses.replace(profile, by_tp={1: new}, pipelines={(1, 2): old})
    assert piped.latency(1, 2).coefficients.prefill_cached == 1e-3
    assert piped.latency(1, 2).coefficients.prefill == old.prefill
    mixed = with_prefill_of(dataclasses.replace(profile, by_tp={1: old}),
                            dataclasses.replace(profile, by_tp={1: new}))
    assert mixed.by_tp[1].prefill_cached == 1e-3


def test_the_grid_keeps_the_chunks_a_models_context_holds() -> None:
    assert Grid.quick().within(512).cached_chunks == ((128, 128),)
    assert Grid().within(1024).cached_chunks == ((128, 256), (128, 512), (256, 256))
    assert Grid().points_for(pipelined=True) == Grid().points - 5
