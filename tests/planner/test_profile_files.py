"""Profile files: every shipped and published profile loads; a malformed file is refused
with a ProfileError naming the file and what is wrong."""

import json
from pathlib import Path

import pytest

from services.planner.profiles import SHIPPED_PROFILES, ProfileError, load_profile

REFERENCE = Path(__file__).resolve().parents[3] / "shared" / "reference" / \
    "distserve-a100-profiles"
OURS = SHIPPED_PROFILES / "smollm2-135m-cpu-1thread.json"


def test_every_shipped_profile_loads() -> None:
    paths = sorted(SHIPPED_PROFILES.glob("*.json"))
    assert paths
    for path in paths:
        assert load_profile(path).by_tp


def test_every_published_artifact_profile_loads() -> None:
    paths = sorted(REFERENCE.glob("*.json"))
    if not paths:
        pytest.skip(f"no published profiles at {REFERENCE}")
    for path in paths:
        for model in json.loads(path.read_text()):
            profile = load_profile(path, model)
            assert profile.by_tp and profile.kv_capacity


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "p.json"
    path.write_text(text)
    return path


@pytest.mark.parametrize(("text", "reason"), [
    ("", "not JSON (line 1 column 1"),
    ("{oops", "not JSON (line 1 column 2"),
    ("[1, 2, 3]", "not a latency profile: expected an object with \"format\""),
    ('{"foo": 1}', "not a latency profile"),
    ('{"model": "x", "prefill": {}}', "not a latency profile"),
    ('{"format": "distserve-profile/1", "model": "smollm2-135m"}',
     "a distserve-profile/1 profile without device, device_memory_bytes, l_m, configs"),
])
def test_a_file_that_is_no_profile_is_named(tmp_path: Path, text: str, reason: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ProfileError) as e:
        load_profile(path)
    assert str(e.value).startswith(f"{path}: {reason}")


def test_short_coefficients_are_refused_at_load(tmp_path: Path) -> None:
    ours = json.loads(OURS.read_text())
    ours["configs"]["1"]["decoding_smallbs"] = [1.0, 2.0]
    with pytest.raises(ProfileError, match=r"p\.json: configs tp 1: decoding_smallbs must be "
                                           r"a list of 3 numbers, got \[1\.0, 2\.0\]"):
        load_profile(_write(tmp_path, json.dumps(ours)))
    artifact = {"facebook/opt-13b": {"1": {"prefill": [1.0], "decoding_smallbs": [1, 2, 3],
                                           "decoding_largebs": [1, 2, 3]}}}
    with pytest.raises(ProfileError, match="model facebook/opt-13b tp 1: prefill must be"):
        load_profile(_write(tmp_path, json.dumps(artifact)))


def test_fields_of_the_wrong_type_are_named(tmp_path: Path) -> None:
    ours = json.loads(OURS.read_text())
    for field, value, reason in (("l_m", "many", "a field of the wrong type"),
                                 ("configs", [], "configs must be a non-empty object"),
                                 ("model", "no-such-model", "unknown model 'no-such-model'"),
                                 ("pipelines", [{"tp": 1}], "pipelines must be a list")):
        path = _write(tmp_path, json.dumps({**ours, field: value}))
        with pytest.raises(ProfileError, match=reason):
            load_profile(path)


def test_a_directory_or_a_missing_file_is_said_to_be_one(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match=f"{tmp_path} is a directory"):
        load_profile(tmp_path)
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile(tmp_path / "gone.json")


@pytest.mark.parametrize("prefill", [[0, 0, 0], [-1, -1, -1], [float("nan"), 1, 1]])
def test_coefficients_that_give_no_prefill_time_are_refused(tmp_path: Path,
                                                             prefill: list[float]) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"opt-13b": {"1": {"prefill": prefill, "decoding_smallbs":
                                                  [1, 1, 1], "decoding_largebs": [1, 1, 1]}}}))
    with pytest.raises(ProfileError, match="give no positive prefill time"):
        load_profile(path)


def test_a_negative_cost_of_cached_tokens_is_refused(tmp_path: Path) -> None:
    ours = json.loads(OURS.read_text())
    ours["configs"]["1"]["prefill_cached"] = -1e-3
    with pytest.raises(ProfileError, match="prefill_cached one >= 0"):
        load_profile(_write(tmp_path, json.dumps(ours)))
