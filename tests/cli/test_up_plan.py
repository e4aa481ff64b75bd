"""`distserve up --plan`: the instances of a plan written by `distserve plan`, with each
phase's tp and pp, as the stack's own flags would give them; a file that is not a plan is
refused with the reason. `distserve profile --tp 1 2` measures both into one profile."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from distserve.cli import build_parser
from distserve.commands.up import apply_plan, planner_env
from services.planner.plan import Plan
from services.planner.profiling import Grid
from tests.model_dirs import write_random

PROFILE = Path(__file__).parents[2] / "profiles" / "smollm2-135m-cpu-1thread.json"


def tp3_profile(path: Path) -> Path:
    """The shipped profile, plus tp 3 at a third of tp 1's times (as `distserve profile --tp
    1 3` would measure on three devices that split the work evenly)."""
    profile = json.loads(PROFILE.read_text())
    one = profile["configs"]["1"]
    profile["configs"]["3"] = {k: [c / 3 for c in v] if isinstance(v, list) else v
                               for k, v in one.items()}
    path.write_text(json.dumps(profile))
    return path


def parsed(*argv: str) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    args = build_parser().parse_args(["up", *argv])
    return args, args.parser


def test_up_takes_the_plans_instances_and_their_tp(tmp_path: Path) -> None:
    plan_file = tmp_path / "plan.json"
    # 512-token prompts within 0.6 s: only a tp 3 prefill instance (about 0.3 s) makes it
    planned = subprocess.run(
        [sys.executable, "-m", "distserve.cli", "plan", "--profile",
         str(tp3_profile(tmp_path / "profile.json")), "--workload", "fixed:512:16", "--ttft",
         "0.6", "--tpot", "0.5", "--rate", "0.5", "--nodes", "1", "--gpus-per-node", "4",
         "--mode", "disaggregated", "--requests", "200", "--workers", "1", "-o",
         str(plan_file)], capture_output=True, text=True, timeout=300)
    assert planned.returncode == 0, planned.stderr
    args, parser = parsed("--plan", str(plan_file), "--mode", "colocated", "--prefill", "5")
    apply_plan(args, parser)
    assert (args.mode, args.prefill, args.decode) == ("disaggregated", 1, 1)
    assert (args.prefill_tp, args.decode_tp, args.prefill_pp, args.decode_pp) == (3, 1, 1, 1)


def test_a_plan_file_is_read_or_refused_with_the_reason(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    plan = {"model": "smollm2-135m", "algorithm": "high-affinity", "rate_rps": 1.0,
            "ttft_s": 1.0, "tpot_s": 0.1, "attainment_target": 0.9, "nodes": 1,
            "gpus_per_node": 4, "prefill": {"tp": 1, "pp": 2, "count": 1, "goodput_rps": 1},
            "decode": {"tp": 1, "pp": 1, "count": 1, "goodput_rps": 1}, "instances": [],
            "devices_used": 3, "per_device_goodput_rps": 1, "predicted_attainment": 1}
    (tmp_path / "pp.json").write_text(json.dumps(plan))
    args, parser = parsed("--plan", str(tmp_path / "pp.json"))
    apply_plan(args, parser)  # pipeline stages as planned
    assert (args.prefill_pp, args.decode_pp) == (2, 1)
    assert args.dtype == "auto"  # a plan from a profile that does not say its dtype
    (tmp_path / "bf16.json").write_text(json.dumps(plan | {"dtype": "bfloat16"}))
    args, parser = parsed("--plan", str(tmp_path / "bf16.json"))
    apply_plan(args, parser)  # the workers in the dtype the plan was priced in
    assert args.dtype == "bfloat16"
    capsys.readouterr()
    args, parser = parsed("--plan", str(tmp_path / "bf16.json"), "--dtype", "float32")
    apply_plan(args, parser)  # ... unless one is given, said
    assert args.dtype == "float32"
    assert "priced its workers in bfloat16" in capsys.readouterr().err
    (tmp_path / "junk.json").write_text("{}")
    for name, reason in (("junk.json", "not a plan from `distserve plan -o`"),
                         ("missing.json", "not a plan")):
        args, parser = parsed("--plan", str(tmp_path / name))
        with pytest.raises(SystemExit) as exit_:
            apply_plan(args, parser)
        assert exit_.value.code == 2
        assert reason in capsys.readouterr().err


@pytest.mark.parametrize(("edits", "reason"), [
    ({"algorithm": "colocated"},
     "a disaggregated plan is made by algorithm high-affinity or low-affinity, not colocated"),
    ({"mode": "chunked", "algorithm": "low-affinity",
      "colocated": {"tp": 1, "pp": 1, "count": 2, "goodput_rps": 1}},
     "a chunked plan is made by algorithm colocated, not low-affinity"),
])
def test_a_plan_whose_algorithm_does_not_make_its_mode_is_refused_as_simulate_refuses_it(
        tmp_path: Path, edits: dict[str, object], reason: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    plan = {"model": "smollm2-135m", "algorithm": "high-affinity", "rate_rps": 1.0,
            "ttft_s": 1.0, "tpot_s": 0.1, "attainment_target": 0.9, "nodes": 1,
            "gpus_per_node": 4, "prefill": {"tp": 1, "pp": 1, "count": 1, "goodput_rps": 1},
            "decode": {"tp": 1, "pp": 1, "count": 1, "goodput_rps": 1}, "instances": [],
            "devices_used": 2, "per_device_goodput_rps": 1, "predicted_attainment": 1, **edits}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    args, parser = parsed("--plan", str(tmp_path / "plan.json"))
    with pytest.raises(SystemExit) as exit_:
        apply_plan(args, parser)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"--plan {tmp_path / 'plan.json'}: not a plan from `distserve plan -o`: " in err
    assert reason in err and "Traceback" not in err


def test_profile_measures_each_tp_into_one_profile(tmp_path: Path) -> None:
    model = write_random(tmp_path / "llama", "llama", num_attention_heads=8,
                         num_key_value_heads=8, head_dim=8)
    out = tmp_path / "profile.json"
    done = subprocess.run([sys.executable, "-m", "distserve.cli", "profile", "--quick",
                           "--model", str(model), "--tp", "1", "2", "-o", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    configs = json.loads(out.read_text())["configs"]
    assert set(configs) == {"1", "2"}
    assert all(len(configs[tp]["prefill"]) == 3 for tp in configs)
    assert "tp 2:" in done.stdout
    # piped to a log, every grid point is a line of its own (a bar would show nothing)
    points = [line for line in done.stdout.splitlines() if " s] tp " in line]
    assert len(points) == 2 * Grid.quick().points
    assert "tp 2: decode batch 32 at context 256" in points[-1]


def prefill_profile(path: Path, factor: float) -> Path:
    """The shipped profile with its prefill `factor` times as long, said to be measured in
    bfloat16 (as `distserve profile --dtype bfloat16` would write it)."""
    profile = json.loads(PROFILE.read_text())
    one = profile["configs"]["1"]
    one["prefill"] = [c * factor for c in one["prefill"]]
    path.write_text(json.dumps(profile | {"dtype": "bfloat16"}))
    return path


@pytest.mark.parametrize(("factor", "chosen"), [(0.5, "bfloat16"), (2.0, "")])
def test_the_plan_prices_prefill_in_the_dtype_of_its_profile_and_up_starts_it_so(
        tmp_path: Path, factor: float, chosen: str, capsys: pytest.CaptureFixture[str]) -> None:
    """512-token prompts within 1.5 s at 0.3 req/s: float32 prefill instances (0.87 s a
    prompt) need two beside the decode instance; one twice as fast (0.43 s) serves alone,
    more per device; one twice as slow (1.7 s) serves none. The plan weighs both prefill
    profiles, keeps the better and says which; `up --plan` starts the prefill instances in
    its dtype, `simulate --plan` prices them with its profile."""
    plan_file = tmp_path / "plan.json"
    planned = subprocess.run(
        [sys.executable, "-m", "distserve.cli", "plan", "--profile", str(PROFILE),
         "--prefill-profile", str(prefill_profile(tmp_path / "bf16.json", factor)),
         "--workload", "fixed:512:16", "--ttft", "1.5", "--tpot", "0.5", "--rate", "0.3",
         "--nodes", "1", "--gpus-per-node", "4", "--mode", "disaggregated", "--requests",
         "200", "--workers", "1", "-o", str(plan_file)], capture_output=True, text=True,
        timeout=300)
    assert planned.returncode == 0, planned.stderr
    plan = Plan.model_validate_json(plan_file.read_text())
    assert [c.label for c in plan.candidates] == ["disaggregated",
                                                  "disaggregated (prefill bfloat16)"]
    assert plan.prefill_dtype == chosen and plan.dtype == ""  # --profile says none
    assert plan.placement == ("1 prefill + 1 decode" if chosen else "2 prefill + 1 decode")
    assert bool(plan.candidates[1].error) == (not chosen)  # the slower one meets no TTFT
    assert f"recommended: {plan.candidate().label}" in " ".join(planned.stdout.split())
    assert bool(plan.prefill_profile) == bool(chosen)
    args, parser = parsed("--plan", str(plan_file), "--planner", "auto")
    apply_plan(args, parser)
    assert (args.mode, args.prefill_dtype) == ("disaggregated", chosen or None)
    # the online planner prices the prefill instances as the plan did
    assert planner_env(args, parser).get("DS_PLANNER_PREFILL_PROFILE") == (
        str((tmp_path / "bf16.json").resolve()) if chosen else None)
    args, parser = parsed("--plan", str(plan_file), "--prefill-dtype", "float32")
    apply_plan(args, parser)  # a dtype given wins, said where the plan priced another
    assert args.prefill_dtype == "float32"
    assert "DS_PLANNER_PREFILL_PROFILE" not in planner_env(args, parser)
    assert ("priced its prefill instances in bfloat16" in capsys.readouterr().err) == bool(
        chosen)
    if chosen:
        # with the planner off, nothing online to price: the plan's profile is not read
        args, parser = parsed("--plan", str(plan_file))
        apply_plan(args, parser)
        assert args.prefill_profile is None
        assert "DS_PLANNER_PREFILL_PROFILE" not in planner_env(args, parser)
        # a plan made with a relative path, moved beside its profile, still finds it
        moved = tmp_path / "moved"
        moved.mkdir()
        (moved / "bf16.json").write_text((tmp_path / "bf16.json").read_text())
        (moved / "plan.json").write_text(plan.model_copy(
            update={"prefill_profile": "bf16.json"}).model_dump_json())
        args, parser = parsed("--plan", str(moved / "plan.json"), "--planner", "auto")
        apply_plan(args, parser)
        assert planner_env(args, parser)["DS_PLANNER_PREFILL_PROFILE"] == str(
            (moved / "bf16.json").resolve())
    for argv, reason in (((), "give --planner auto"),
                         (("--planner", "auto"), "measured in bfloat16, the prefill "
                          "instances compute in float32"),
                         (("--planner", "auto", "--prefill-dtype", "bfloat16"), "")):
        args, parser = parsed("--prefill-profile", str(tmp_path / "bf16.json"), *argv)
        if not reason:  # the prefill instances' dtype: taken
            assert planner_env(args, parser)["DS_PLANNER_PREFILL_PROFILE"]
            continue
        with pytest.raises(SystemExit):
            planner_env(args, parser)
        assert reason in capsys.readouterr().err
    args, parser = parsed("--prefill-profile", str(PROFILE), "--planner", "auto")
    with pytest.raises(SystemExit):  # says no dtype: refused
        planner_env(args, parser)
    assert "does not say the dtype" in capsys.readouterr().err
    simulated = subprocess.run(
        [sys.executable, "-m", "distserve.cli", "simulate", "--plan", str(plan_file),
         "--workload", "fixed:512:16", "--requests", "100"],
        capture_output=True, text=True, timeout=300)
    assert simulated.returncode == 0, simulated.stderr
    found = re.search(r"ttft_s\s*\W\s*([\d.]+)", simulated.stdout)
    assert found is not None, simulated.stdout
    ttft_p50 = float(found.group(1))
    assert ttft_p50 < 0.6 if chosen else ttft_p50 > 0.8  # 0.43 s or 0.87 s alone
    if chosen:  # a plan whose prefill profile is gone says which file it wanted
        gone = plan.model_copy(update={"prefill_profile": str(tmp_path / "gone.json")})
        plan_file.write_text(gone.model_dump_json())
        failed = subprocess.run(
            [sys.executable, "-m", "distserve.cli", "simulate", "--plan", str(plan_file),
             "--workload", "fixed:512:16", "--requests", "20"], capture_output=True,
            text=True, timeout=300)
        assert failed.returncode == 2 and "the plan's prefill_profile" in failed.stderr
        assert "Traceback" not in failed.stderr
