"""`distserve plan` / `simulate` from the command line: tables, JSON, plots, clear errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from distserve.cli import COMMANDS, build_parser, main
from services.planner.plan import Plan

REFERENCE = Path(__file__).parents[3] / "shared"
PROFILE = REFERENCE / "reference" / "distserve-a100-profiles" / "profiler-a100-80g.distserve.json"
VLLM = PROFILE.with_name("profiler-a100-80g.vllm.json")
SHAREGPT = f"sharegpt:{REFERENCE / 'data' / 'sharegpt_v3_filtered_1000_prompts.json'}"
BASE = ["--profile", str(PROFILE), "--model", "facebook/opt-13b", "--workload", SHAREGPT,
        "--ttft", "0.25", "--tpot", "0.1", "--requests", "150"]


def distserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "distserve.cli", *args], capture_output=True,
                          text=True, timeout=600)


def test_plan_json_then_simulate_and_sweep(tmp_path: Path) -> None:
    plan_file = tmp_path / "plan.json"
    result = distserve("plan", *BASE, "--rate", "4", "--nodes", "1", "--gpus-per-node", "8",
                       "--json", "-o", str(plan_file), "--baseline-profile", str(VLLM))
    assert result.returncode == 0, result.stderr
    plan = Plan.model_validate_json(result.stdout.strip().splitlines()[-1])
    assert plan.devices_used <= 8 and plan.predicted_attainment >= 0.9
    assert re.search(r"best\s+per-device\s+goodput:\s+\w+\s+[\d.]+\s+req/s,\s+colocated\s+"
                     r"baseline\s+[\d.]+\s+req/s:\s+[\d.]+x", result.stderr)
    # every mode weighed; the plan is the best of them, side by side in the table
    assert [c.mode for c in plan.candidates] == ["disaggregated", "colocated", "chunked"]
    assert all(c.best_per_device_goodput_rps > 0 and not c.error for c in plan.candidates)
    # of the placements that serve the rate, the fewest devices, then the most served per
    # device simulated whole (which Algorithm 1's per-phase figure bounds from above)
    assert all(c.served_per_device_rps > 0 for c in plan.candidates)
    serving = [c for c in plan.candidates if c.predicted_attainment >= 0.9]
    assert plan.predicted_attainment >= 0.9 and plan.devices_used == min(
        c.devices_used for c in serving)
    assert plan.served_per_device_rps == max(c.served_per_device_rps for c in serving
                                             if c.devices_used == plan.devices_used)
    # the searches' figures bound it: each phase alone, or the short runs of a search
    assert all(c.served_per_device_rps <= 1.05 * c.best_per_device_goodput_rps
               for c in plan.candidates)
    assert "serving modes" in result.stderr and f"recommended: {plan.mode}" in result.stderr
    sim = distserve("simulate", "--plan", str(plan_file), "--workload", SHAREGPT,
                    "--requests", "300")
    assert sim.returncode == 0, sim.stderr
    assert "attainment" in sim.stdout and "prefill_queue" in sim.stdout
    out = tmp_path / "sweep"
    sweep = distserve("simulate", "--sweep", "--plan", str(plan_file), "--workload", SHAREGPT,
                      "--rates", "1,4,16", "--requests", "200", "--baseline-profile", str(VLLM),
                      "--out", str(out))
    assert sweep.returncode == 0, sweep.stderr
    curves = json.loads((out / "sweep.json").read_text())
    assert set(curves) == {plan.mode, "colocated baseline"}
    assert len(curves["colocated baseline"]["attainment"]) == 3
    assert (out / "sweep.png").stat().st_size > 1000


def test_a_colocated_mode_plan_simulates_as_planned(tmp_path: Path) -> None:
    plan_file = tmp_path / "plan.json"
    result = distserve("plan", *BASE, "--rate", "4", "--nodes", "1", "--gpus-per-node", "8",
                       "--mode", "chunked", "-o", str(plan_file))
    assert result.returncode == 0, result.stderr
    plan = Plan.model_validate_json(plan_file.read_text())
    assert plan.mode == "chunked" and plan.colocated is not None and plan.prefill is None
    assert [c.mode for c in plan.candidates] == ["chunked"]
    assert plan.predicted_attainment >= 0.9
    sim = distserve("simulate", "--plan", str(plan_file), "--workload", SHAREGPT,
                    "--requests", "300", "--rate", "4")
    assert sim.returncode == 0, sim.stderr
    assert "attainment" in sim.stdout


@pytest.mark.parametrize(("args", "code", "message"), [
    (["--rate", "4", "--nodes", "1", "--gpus-per-node", "8", "--ttft", "-1"], 2,
     "argument --ttft: must be a positive number"),
    (["--rate", "1", "--nodes", "1", "--gpus-per-node", "8", "--model", "nope"], 2,
     "no profile for model 'nope'"),
    (["--rate", "1", "--nodes", "1", "--gpus-per-node", "8", "--ttft", "0.0001"], 1,
     "no feasible plan"),
    (["--rate", "1", "--nodes", "0", "--gpus-per-node", "8"], 2, "at least 1"),
    (["--rate", "1", "--nodes", "1", "--gpus-per-node", "8", "--prefill-profile", str(VLLM)], 2,
     "does not say the dtype it was measured in"),
    (["--rate", "1", "--nodes", "1", "--gpus-per-node", "8", "--prefill-profile", str(VLLM),
      "--mode", "colocated"], 2, "--mode colocated has none"),
])
def test_plan_errors_are_clear(args: list[str], code: int, message: str) -> None:
    result = distserve("plan", *BASE, *args)
    assert result.returncode == code
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_plan_takes_the_benchmarks_default_workload(tmp_path: Path) -> None:
    """humaneval, what `bench compare` sends unless told otherwise, is a workload the planner
    plans for, on a shipped CPU profile."""
    shipped = Path(__file__).parents[2] / "profiles" / "smollm2-135m-cpu-1thread-amd-epyc-zen5.json"
    plan_file = tmp_path / "plan.json"
    result = distserve("plan", "--profile", str(shipped), "--workload", "humaneval",
                       "--ttft", "1", "--tpot", "0.05", "--rate", "1", "--nodes", "1",
                       "--gpus-per-node", "2", "--requests", "200", "-o", str(plan_file))
    assert result.returncode == 0, result.stderr
    plan = Plan.model_validate_json(plan_file.read_text())
    assert plan.model == "smollm2-135m" and plan.devices_used <= 2
    assert {c.mode for c in plan.candidates} == {"disaggregated", "colocated", "chunked"}
    sim = distserve("simulate", "--plan", str(plan_file), "--workload", "humaneval",
                    "--requests", "200")
    assert sim.returncode == 0, sim.stderr
    assert "attainment" in sim.stdout


def test_unknown_workload_is_a_clear_error() -> None:
    args = [a if a != SHAREGPT else "poisson:nothing" for a in BASE]
    result = distserve("plan", *args, "--rate", "1", "--nodes", "1", "--gpus-per-node", "8")
    assert result.returncode == 2 and "unknown workload" in result.stderr


def test_plan_names_what_is_missing_and_live_needs_a_stack(tmp_path: Path) -> None:
    result = distserve("plan", "--ttft", "1", "--tpot", "1")
    assert result.returncode == 2
    assert "required: --profile, --workload, --rate, --nodes, --gpus-per-node" in result.stderr
    result = distserve("plan", "--live", "--run-dir", str(tmp_path))
    assert result.returncode == 2 and "no running stack found" in result.stderr
    result = distserve("plan", "--replan", *BASE, "--rate", "1", "--nodes", "1",
                       "--gpus-per-node", "8")
    assert result.returncode == 2 and "--replan goes with --live" in result.stderr


@pytest.mark.parametrize("command", ["plan", "simulate", "up", "replay"])
def test_the_planner_commands_start_without_loading_torch(command: str) -> None:
    """A command line imports only its own command's module: torch, which `bench`,
    `generate` and `profile` need, took 4 of the 5 s `distserve plan` spent starting."""
    code = ("import sys; from distserve.cli import build_parser; build_parser(sys.argv[1]); "
            "print(sorted(m for m in ('torch', 'distserve.commands.bench') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code, command], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_whole_help_still_lists_every_command() -> None:
    text = build_parser().format_help()
    assert all(f"    {command} " in text for command in COMMANDS)


@pytest.mark.parametrize("module", [
    "services.gateway.__main__", "services.profiler.__main__", "distserve.commands.bench",
    # the planner's settings, made as its process does: its profile less what cannot run here
    "services.planner.service; services.planner.service.PlannerSettings().config()"])
def test_the_services_beside_the_workers_start_without_torch(module: str) -> None:
    """The gateway, the planner and the profiler serve beside the workers, and `bench
    compare` drives a stack from a process beside it: none loads the engine (torch) on a
    host without GPUs."""
    code = f"import sys, {module}; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


CPU_PROFILE = Path(__file__).parents[2] / "profiles" / "smollm2-135m-cpu-1thread.json"
CPU_PLAN = ["plan", "--profile", str(CPU_PROFILE), "--workload", "humaneval", "--ttft", "3.5",
            "--tpot", "0.1", "--nodes", "1", "--gpus-per-node", "1", "--requests", "300"]


def exits_with_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """`distserve argv` in this process: it stops as argparse does, exit 2; its message."""
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(("args", "message"), [
    (["--rate", "1", "--requests", "-5"], "argument --requests: must be a positive integer"),
    (["--rate", "1", "--requests", "0"], "argument --requests: must be a positive integer"),
    (["--rate", "1", "--cv", "0"], "argument --cv: must be a positive number"),
    (["--rate", "1", "--workers", "-1"], "argument --workers: must be 0 or more"),
    (["--rate", "1", "--intra-bw", "0"], "argument --intra-bw: must be a positive number"),
    (["--rate", "1", "--inter-bw", "-1"], "argument --inter-bw: must be a positive number"),
    (["--rate", "inf"], "argument --rate: must be a positive number, got inf"),
    (["--rate", "nan"], "argument --rate: must be a positive number, got nan"),
    (["--rate", "1", "--ttft", "nan"], "argument --ttft: must be a positive number, got nan"),
    (["--rate", "1", "--seed", "-1"], "argument --seed: must be 0 or more"),
    (["--rate", "1", "--max-context", "0"], "argument --max-context: must be a positive"),
])
def test_plan_rejects_bad_numbers_as_it_parses(args: list[str], message: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert message in exits_with_usage_error([*CPU_PLAN, *args], capsys)


def test_plan_checks_its_output_path_before_searching(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = exits_with_usage_error([*CPU_PLAN, "--rate", "1", "-o", str(tmp_path)], capsys)
    assert f"--output {tmp_path} is a directory" in err
    missing = tmp_path / "nodir" / "plan.json"
    err = exits_with_usage_error([*CPU_PLAN, "--rate", "1", "-o", str(missing)], capsys)
    assert f"no such directory {missing.parent}" in err


def test_plan_says_when_no_placement_meets_the_target_at_the_rate(tmp_path: Path) -> None:
    """It still writes the best placement found, and says plainly that it misses."""
    plan_file = tmp_path / "plan.json"
    result = distserve(*CPU_PLAN, "--rate", "0.38", "--json", "-o", str(plan_file))
    assert result.returncode == 0, result.stderr
    plan = Plan.model_validate_json(result.stdout.strip().splitlines()[-1])
    assert plan.predicted_attainment < plan.attainment_target
    assert Plan.model_validate_json(plan_file.read_text()) == plan
    text = " ".join(result.stderr.split())  # the tables wrap
    assert (f"recommended: {plan.mode} (no placement meets the 90% attainment target at "
            "0.38 req/s on 1 device; of the best found") in text
    assert "warning: no placement meets the 90% attainment target" in text
    assert "the plan written is the best found" in text
    assert "instances that serve the rate" not in text


def test_plan_json_says_when_there_is_no_plan() -> None:
    result = distserve(*CPU_PLAN, "--rate", "1", "--ttft", "0.0001", "--json")
    assert result.returncode == 1 and "no feasible plan" in result.stderr
    verdict = json.loads(result.stdout.strip().splitlines()[-1])
    assert verdict["feasible"] is False
    assert {m["mode"] for m in verdict["modes"]} == {"disaggregated", "colocated", "chunked"}


def cpu_plan(tmp_path: Path, **edits: object) -> Path:
    """A chunked colocated plan on one CPU device, as `distserve plan` writes one, edited."""
    plan = {"model": "smollm2-135m", "algorithm": "colocated", "mode": "chunked",
            "rate_rps": 0.2, "ttft_s": 3.5, "tpot_s": 0.1, "attainment_target": 0.9,
            "nodes": 1, "gpus_per_node": 1,
            "colocated": {"tp": 1, "pp": 1, "count": 1, "goodput_rps": 0.44},
            "instances": [{"role": "colocated", "tp": 1, "pp": 1, "devices": [[0, 0]]}],
            "devices_used": 1, "per_device_goodput_rps": 0.44, "predicted_attainment": 0.95,
            "profile": str(CPU_PROFILE), **edits}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    return path


@pytest.mark.parametrize(("edits", "message"), [
    ({"instances": [{"role": "colocated", "tp": -2, "pp": 1, "devices": [[0, 0]]}]},
     "instances[0] (colocated tp -2 pp 1) is not a configuration of its profile"),
    ({"instances": [{"role": "colocated", "tp": 64, "pp": 1, "devices": [[0, 0]]}]},
     "instances[0] (colocated tp 64 pp 1) is not a configuration of its profile"),
    ({"instances": []}, "it has no instances"),
    ({"ttft_s": 0}, "ttft_s"),
    ({"rate_rps": -3}, "rate_rps"),
    ({"rate_rps": float("inf")}, "rate_rps"),
    ({"colocated": None}, "a chunked plan needs colocated"),
    ({"mode": "disaggregated"}, "a disaggregated plan needs both prefill and decode"),
    ({"algorithm": "high-affinity"},
     "a chunked plan is made by algorithm colocated, not high-affinity"),
])
def test_simulate_names_what_is_wrong_in_a_hand_edited_plan(
        edits: dict[str, object], message: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    plan = cpu_plan(tmp_path, **edits)
    err = exits_with_usage_error(["simulate", "--plan", str(plan), "--workload", "humaneval",
                                  "--requests", "20"], capsys)
    assert str(plan) in err and message in err


@pytest.mark.parametrize(("args", "message"), [
    (["--sweep", "--rates", "abc"], "argument --rates: takes comma-separated positive numbers"),
    (["--sweep", "--rates", "0.1,,0.2"], "takes comma-separated positive numbers"),
    (["--sweep", "--rates=-1,0"], "argument --rates: must be a positive number, got -1"),
    (["--requests", "-3"], "argument --requests: must be a positive integer"),
    (["--requests", "0"], "argument --requests: must be a positive integer"),
    (["--rate", "0"], "argument --rate: must be a positive number, got 0"),
])
def test_simulate_rejects_bad_arguments(args: list[str], message: str, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--plan", str(cpu_plan(tmp_path)), "--workload", "humaneval", *args]
    assert message in exits_with_usage_error(argv, capsys)


def test_a_plan_file_that_is_not_text_is_refused_by_simulate_and_up(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = tmp_path / "plan.json"
    plan.write_bytes(b"\xff\xfe\x00")
    err = exits_with_usage_error(["simulate", "--plan", str(plan), "--workload", "humaneval"],
                                 capsys)
    assert "is not a plan: not UTF-8 text" in err
    err = exits_with_usage_error(["up", "--plan", str(plan)], capsys)
    assert f"--plan {plan}: not a plan" in err and "cannot read it" in err


def test_simulate_rejects_a_folder_for_a_plan_and_a_file_for_a_sweep(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = exits_with_usage_error(["simulate", "--plan", str(tmp_path), "--workload",
                                  "humaneval"], capsys)
    assert f"cannot read {tmp_path}: Is a directory" in err
    plan = cpu_plan(tmp_path)
    err = exits_with_usage_error(["simulate", "--sweep", "--plan", str(plan), "--workload",
                                  "humaneval", "--rates", "0.1", "--out", str(plan)], capsys)
    assert f"--out {plan} is a file" in err


def test_a_sweep_that_always_meets_the_target_gives_a_lower_bound(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    result = distserve("simulate", "--sweep", "--plan", str(cpu_plan(tmp_path)), "--workload",
                       "humaneval", "--rates", "0.05,0.1", "--requests", "50", "--out",
                       str(out))
    assert result.returncode == 0, result.stderr
    assert "goodput at least 0.10 req/s (the highest rate swept)" in result.stdout
    curves = json.loads((out / "sweep.json").read_text())
    assert curves["chunked"]["goodput_lower_bound"] is True


def test_a_plan_made_with_a_relative_profile_simulates_from_any_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`plan` records the profile's whole path; a plan naming it relatively (an older or a
    hand-edited one), or by a whole path that is gone (the folder moved), finds it beside the
    plan file."""
    made, moved, elsewhere = tmp_path / "made", tmp_path / "moved", tmp_path / "elsewhere"
    for folder in (made, moved, elsewhere):
        folder.mkdir()
    for folder in (made, moved):
        (folder / "profile.json").write_text(CPU_PROFILE.read_text())
    monkeypatch.chdir(made)
    assert main(["plan", "--profile", "profile.json", "--workload", "fixed:64:8", "--ttft", "3.5",
                 "--tpot", "0.1", "--nodes", "1", "--gpus-per-node", "1", "--rate", "0.2",
                 "--mode", "colocated", "--requests", "20", "--workers", "1", "-o",
                 "plan.json"]) == 0
    plan = Plan.model_validate_json((made / "plan.json").read_text())
    assert plan.profile == str((made / "profile.json").resolve())
    monkeypatch.chdir(elsewhere)
    for plan_file in (made / "plan.json", cpu_plan(moved, profile="profile.json")):
        assert main(["simulate", "--plan", str(plan_file), "--workload", "fixed:64:8",
                     "--requests", "20"]) == 0
    # the folder moved (or copied to another host) with its plan and profile: the whole path
    # recorded is gone, and the profile beside the plan is read
    made.rename(tmp_path / "carried")
    assert main(["simulate", "--plan", str(tmp_path / "carried" / "plan.json"), "--workload",
                 "fixed:64:8", "--requests", "20"]) == 0


def test_prefix_caches_of_each_instance_are_simulated_with_their_pools(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--prefix-cache pool`: each instance keeps the prompts it computes in its KV pool.
    One replica finds what one cache of all the prompts would (the 1,024 turns the workload
    has); two replicas sent the turns
    of a busy chat find less, each missing what went to the other."""
    chat = ["--workload", "chat:64:32:16:4:2", "--prefix-cache", "pool"]
    plan_file = tmp_path / "plan.json"
    assert main(["plan", "--profile", str(Path("profiles") / "smollm2-135m-cpu-1thread.json"),
                 *chat, "--ttft", "3", "--tpot", "0.15", "--rate", "2", "--nodes", "1",
                 "--gpus-per-node", "1", "--requests", "100", "-o", str(plan_file)]) == 0
    printed = capsys.readouterr()
    one = float(re.findall(r"unlimited prefix cache would hold ([\d.]+)%", printed.err)[0])
    plan = Plan.model_validate_json(plan_file.read_text())
    assert [i.role for i in plan.instances] == ["colocated"]
    weighed = [c for c in plan.candidates if not c.error]  # each mode's placement's share
    assert weighed and all(0 < (c.cached_share or 0) <= one / 100 + 0.01 for c in weighed)
    assert re.search(r"its instances' prefix caches find [\d.]+% of the prompt tokens",
                     " ".join(printed.out.split()))

    def found(rate: str, p: Plan) -> float:
        plan_file.write_text(p.model_dump_json())
        assert main(["simulate", "--plan", str(plan_file), *chat, "--rate", rate,
                     "--requests", "1024"]) == 0
        return float(re.findall(r"prefix caches found ([\d.]+)% of the prompt tokens",
                                capsys.readouterr().out)[0])

    assert found("2", plan) == one
    two = plan.model_copy(update={"instances": plan.instances * 2, "devices_used": 2})
    assert found("8", two) < one
    with pytest.raises(SystemExit):
        main(["plan", *chat[:3], "pools", "--profile", "x.json"])
    assert "pool, a number of tokens or 'unlimited'" in capsys.readouterr().err
