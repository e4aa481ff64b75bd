"""Benchmark workloads: real prompts and traces from ../shared/data, arrivals per rate."""

from pathlib import Path

import numpy as np
import pytest

from distserve.bench.workload import Limits, as_simulated, parse_bench_workload
from shared.workloads import WorkloadError

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"


def test_humaneval_has_its_164_prompts_with_solution_lengths() -> None:
    w = parse_bench_workload("humaneval", Limits(max_prompt=4096, max_output=4096))
    assert len(w.items) == 164
    first = w.items[0]
    assert isinstance(first.prompt, str) and "def has_close_elements" in first.prompt
    # the canonical solution of HumanEval/0 is a short double loop: tens of tokens
    assert 20 < first.output_tokens < 120
    assert all(i.prompt_tokens > 10 for i in w.items)


def test_limits_cut_prompts_and_outputs() -> None:
    w = parse_bench_workload("humaneval", Limits(max_prompt=64, max_output=32))
    assert max(i.prompt_tokens for i in w.items) == 64
    assert max(i.output_tokens for i in w.items) == 32


def test_requests_scale_arrivals_with_rate_and_keep_the_same_requests() -> None:
    w = parse_bench_workload("fixed:100:20", Limits())
    slow, fast = w.requests(1.0, 50, seed=3), w.requests(4.0, 50, seed=3)
    assert slow[0].arrival_s == 0.0
    assert [r.arrival_s / 4 for r in slow] == pytest.approx([r.arrival_s for r in fast])
    assert [r.prompt for r in slow] == [r.prompt for r in fast]
    assert all(len(r.prompt) == 100 and r.max_tokens == 20 for r in slow)
    assert slow[1].prompt != slow[2].prompt  # synthetic prompts differ per request
    gaps = np.diff([r.arrival_s for r in w.requests(1.0, 4000, seed=1)])
    assert gaps.mean() == pytest.approx(1.0, rel=0.05)  # Poisson at 1 req/s
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)
    bursty = parse_bench_workload("fixed:100:20", Limits(), cv=3.0)
    gaps = np.diff([r.arrival_s for r in bursty.requests(1.0, 4000, seed=1)])
    assert gaps.std() / gaps.mean() == pytest.approx(3.0, rel=0.15)


def test_trace_replays_its_lengths_in_order_scaled_to_fit() -> None:
    w = parse_bench_workload(f"azure:{DATA / 'AzureLLMInferenceTrace_conv.csv'}",
                             Limits(max_prompt=512, max_output=128, length_scale=0.25))
    requests = w.requests(2.0, 100)
    # first Azure rows: ContextTokens 374, 396, 879 ... x 0.25
    assert [r.prompt_tokens for r in requests[:2]] == [round(374 * 0.25), round(396 * 0.25)]
    assert max(r.prompt_tokens for r in requests) <= 512
    assert max(r.max_tokens for r in requests) <= 128
    span = requests[-1].arrival_s - requests[0].arrival_s
    assert span == pytest.approx(99 / 2.0)  # the replayed segment runs at the rate asked
    gaps = np.diff([r.arrival_s for r in requests])
    assert gaps.std() / gaps.mean() > 0.5  # with the trace's own irregular gaps
    sim = as_simulated(requests)
    assert sim[5].prompt_tokens == requests[5].prompt_tokens == len(requests[5].prompt)


def test_sharegpt_prompts_are_text_with_drawn_output_lengths() -> None:
    w = parse_bench_workload(f"sharegpt:{DATA / 'sharegpt_v3_filtered_1000_prompts.json'}",
                             Limits(max_prompt=256, max_output=256))
    assert len(w.items) == 1000
    assert all(isinstance(i.prompt, str) for i in w.items)
    outputs = np.array([i.output_tokens for i in w.items])
    assert 80 < np.median(outputs) < 180  # Azure conversation median 129


def test_unknown_or_malformed_workloads_are_named() -> None:
    for spec in ("humaneva", "fixed:10", "fixed:0:5", "sharegpt:"):
        with pytest.raises(WorkloadError):
            parse_bench_workload(spec, Limits())
    with pytest.raises(WorkloadError, match="does not exist"):
        parse_bench_workload("mooncake:/no/such/file.jsonl", Limits())


def test_plan_and_simulate_read_humaneval_as_bench_sends_it() -> None:
    """`distserve plan --workload humaneval` plans for the lengths `bench` measures with."""
    from distserve.commands.workload_arg import parse_workload

    planned = parse_workload("humaneval", max_context=2048).lengths
    sent = parse_bench_workload("humaneval", Limits()).items
    assert planned.prompts.tolist() == [i.prompt_tokens for i in sent]
    assert planned.outputs.tolist() == [i.output_tokens for i in sent]
    with pytest.raises(WorkloadError, match="use humaneval, sharegpt:PATH"):
        parse_workload("humaneval:extra")


def test_a_workload_file_that_is_not_its_format_is_named(tmp_path: Path) -> None:
    from shared.workloads import read_azure_trace, read_mooncake_trace, read_sharegpt_prompts

    text = tmp_path / "trace.csv"
    text.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50,many,44\n")
    with pytest.raises(WorkloadError, match=f"{text} is not JSON \\(line 1 column 1"):
        read_sharegpt_prompts(text)
    with pytest.raises(WorkloadError, match=f"{text} line 1 is not JSON"):
        read_mooncake_trace(text)
    with pytest.raises(WorkloadError, match=f"{text} line 3 is not an Azure trace row"):
        read_azure_trace(text)
    jsonl = tmp_path / "trace.jsonl"
    jsonl.write_text('{"timestamp": 0, "input_length": 5, "output_length": 2}\n\n'
                     '{"timestamp": 1, "input_length": 5}\n')
    with pytest.raises(WorkloadError, match=f"{jsonl} line 3 is not a Mooncake request"):
        read_mooncake_trace(jsonl)
    with pytest.raises(WorkloadError, match=f"{jsonl}: not an Azure trace"):
        read_azure_trace(jsonl)
    jsonl.write_text('[{"conversations": 5}, {"conversations": [3, {"from": "human"}]}, 1]')
    with pytest.raises(WorkloadError, match="no ShareGPT conversations with a human turn"):
        read_sharegpt_prompts(jsonl)
    binary = tmp_path / "trace.bin"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(WorkloadError, match="is not a text file"):
        read_mooncake_trace(binary)


def test_a_directory_is_said_to_be_one(tmp_path: Path) -> None:
    for spec in ("sharegpt", "azure", "mooncake"):
        with pytest.raises(WorkloadError, match=f"{tmp_path} is a directory"):
            parse_bench_workload(f"{spec}:{tmp_path}", Limits())
