"""Placement search with the published A100 profiles (read from ../shared/reference) and
the real ShareGPT prompts (../shared/data)."""

from __future__ import annotations

import functools
import statistics
from pathlib import Path

import pytest

from services.planner.baseline import colocated_plan
from services.planner.low_affinity import low_affinity
from services.planner.placement import NoFeasiblePlan, Problem, high_affinity
from services.planner.plan import Plan
from services.planner.profiles import ProfileError, kv_capacity_tokens, load_profile
from shared.engine.meta import read_tokenizer
from shared.metrics import SLO
from shared.workloads import Workload, read_trace, sharegpt_lengths

REFERENCE = Path(__file__).parents[3] / "shared"
PROFILES = REFERENCE / "reference" / "distserve-a100-profiles"
DISTSERVE = PROFILES / "profiler-a100-80g.distserve.json"
VLLM = PROFILES / "profiler-a100-80g.vllm.json"
SHAREGPT = REFERENCE / "data" / "sharegpt_v3_filtered_1000_prompts.json"
AZURE_CONV = REFERENCE / "data" / "AzureLLMInferenceTrace_conv.csv"
OPT_CONTEXT = 2048


@functools.cache
def chatbot() -> Workload:
    """First-turn ShareGPT prompts (token-counted), Azure-trace output lengths."""
    tokenizer = read_tokenizer("smollm2-135m")
    lengths = sharegpt_lengths(SHAREGPT, lambda text: len(tokenizer.encode(text)))
    return Workload(lengths.within(OPT_CONTEXT))


@functools.cache
def chat_with_history() -> Workload:
    """Chat requests that carry their conversation so far: the shape of the paper's ShareGPT
    workload, whose artifact builds each prompt from the first k turns of a conversation of
    3+ turns and keeps those within OPT's 2048-token context. Real ones: the Azure
    conversation trace, within the same context."""
    return Workload(read_trace("azure", AZURE_CONV).lengths.within(OPT_CONTEXT))


def problem(profile: Path, model: str, slo: SLO, rate: float, nodes: int = 1,
            gpus: int = 8, requests: int = 300, workload: Workload | None = None,
            seed: int = 0) -> Problem:
    return Problem(load_profile(profile, model), workload or chatbot(), slo, rate, nodes, gpus,
                   num_requests=requests, seed=seed, workers=2)


def goodput_ratio(model: str, slo: SLO, rate: float, workload: Workload, requests: int,
                  seed: int = 0) -> tuple[float, float]:
    """Best per-GPU goodput: disaggregated (DistServe profile) and colocated (vLLM's)."""
    disaggregated = high_affinity(problem(DISTSERVE, model, slo, rate, requests=requests,
                                          workload=workload, seed=seed))
    colocated = colocated_plan(problem(VLLM, model, slo, rate, requests=requests,
                                       workload=workload, seed=seed))
    return disaggregated.best_per_device_goodput_rps, colocated.best_per_device_goodput_rps


def check_plan(plan: Plan, p: Problem) -> None:
    devices = [d for i in plan.instances for d in i.devices]
    assert len(devices) == len(set(devices)) == plan.devices_used  # no device twice
    assert all(0 <= n < p.nodes and 0 <= g < p.gpus_per_node for n, g in devices)
    largest = int((p.workload.lengths.prompts + p.workload.lengths.outputs).max())
    for i in plan.instances:
        assert len(i.devices) == i.tp * i.pp
        assert kv_capacity_tokens(p.profile, i.tp, i.pp) >= largest  # fits in memory
        for stage in range(i.pp):  # a stage's tensor-parallel devices share a node
            assert len({n for n, _ in i.devices[stage * i.tp:(stage + 1) * i.tp]}) == 1
    assert plan.predicted_attainment >= p.target  # meets the target rate


def test_opt13b_chatbot_disaggregated_doubles_colocated_goodput() -> None:
    """The paper's setting (OPT-13B, A100 profiles, TTFT 0.25 s, TPOT 0.1 s, chat requests
    with their history): at least 2x per GPU. Near the target the colocated attainment curve
    is shallow (long prompts miss TTFT at any rate), so one sample of requests moves its
    goodput by +-15%: the median of three independent samples of 2,000 requests."""
    slo = SLO(ttft_s=0.25, tpot_s=0.1)
    ratios = []
    for seed in range(3):
        disaggregated, colocated = goodput_ratio("facebook/opt-13b", slo, 4.0,
                                                 chat_with_history(), 2000, seed)
        ratios.append(disaggregated / colocated)
        print(f"\nOPT-13B chat with history, seed {seed}: disaggregated {disaggregated:.2f} "
              f"req/s/GPU vs colocated {colocated:.2f}: {ratios[-1]:.2f}x (paper: 2.0-4.6x)")
    assert statistics.median(ratios) >= 2.0


def test_opt13b_first_turn_prompts_disaggregated_still_wins() -> None:
    """First-turn ShareGPT prompts only (mean ~190 tokens, the only ShareGPT text here):
    OPT-13B prefill on an A100 is then cheap, and the colocated baseline is bound by decode
    throughput and KV memory more than by interference, so disaggregation gains less
    (1.5-1.7x over three seeds; docs/benchmarks.md)."""
    slo = SLO(ttft_s=0.25, tpot_s=0.1)
    disaggregated, colocated = goodput_ratio("facebook/opt-13b", slo, 4.0, chatbot(), 2000)
    print(f"\nOPT-13B first-turn ShareGPT prompts: disaggregated {disaggregated:.2f} req/s/GPU "
          f"vs colocated {colocated:.2f}: {disaggregated / colocated:.2f}x")
    assert disaggregated / colocated >= 1.3


@pytest.mark.parametrize("search", [high_affinity, low_affinity])
def test_opt66b_plans_respect_cluster_memory_and_rate(search: object) -> None:
    p = problem(DISTSERVE, "facebook/opt-66b", SLO(2.5, 0.15), rate=6.0, nodes=4, requests=200)
    plan = search(p)  # type: ignore[operator]
    check_plan(plan, p)
    assert plan.prefill is not None and plan.decode is not None


def test_impossible_slo_is_reported_not_crashed() -> None:
    p = problem(DISTSERVE, "facebook/opt-13b", SLO(0.001, 0.1), rate=1.0, requests=100)
    with pytest.raises(NoFeasiblePlan, match=r"meets TTFT 0\.001s"):
        high_affinity(p)


def test_cluster_too_small_for_the_model() -> None:
    p = problem(DISTSERVE, "facebook/opt-66b", SLO(2.5, 0.15), rate=1.0, nodes=1, gpus=1)
    with pytest.raises(NoFeasiblePlan, match="does not fit"):
        high_affinity(p)


def test_rate_beyond_the_cluster() -> None:
    p = problem(DISTSERVE, "facebook/opt-13b", SLO(0.25, 0.1), rate=500.0, requests=100)
    with pytest.raises(NoFeasiblePlan, match=r"within 1 x 8 devices|more than"):
        high_affinity(p)


def test_unknown_model_in_profile() -> None:
    with pytest.raises(ProfileError, match="no profile for model 'llama-9000'"):
        load_profile(DISTSERVE, "llama-9000")
