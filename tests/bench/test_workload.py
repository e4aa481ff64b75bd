"""Benchmark workloads: real prompts and traces from ../shared/data, arrivals per rate."""

import json
from pathlib import Path

import numpy as np
import pytest

from distserve.bench.workload import Limits, as_simulated, parse_bench_workload
from shared.workloads import WorkloadError, read_trace

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


def test_a_prefix_cache_finds_the_blocks_earlier_prompts_ended_while_it_keeps_them() -> None:
    from shared.workloads import cached_tokens, prefix_found

    prefixes = [(0, 1), (0, 1, 2), (0, 3), (4,), (0, 1, 2, 5)]
    blocks = [len(p) for p in prefixes]  # a token a block
    assert prefix_found(prefixes, blocks).tolist() == [0, 2, 1, 0, 3]
    # three blocks kept, least recently used out: (4,) pushes out 1 and 2 (0 and 3 are newer
    # than them), so the last prompt finds its first block only
    assert prefix_found(prefixes, blocks, capacity=3).tolist() == [0, 2, 1, 0, 1]
    # of 64-token blocks and 16-token pages: a 100-token prompt leaves 96 tokens, and the
    # same prompt again finds them; one that goes on past it, those of its part in common
    prefixes, prompts = [(0, 1), (0, 1), (0, 1, 2), (0, 3)], [100, 100, 150, 70]
    assert prefix_found(prefixes, prompts, 64, page=16).tolist() == [0, 96, 96, 64]
    # a cache finds whole 16-token pages, never the page of a prompt's last token
    found, prompts = np.array([0, 128, 64, 128, 128]), np.array([100, 100, 100, 129, 130])
    assert cached_tokens(found, prompts).tolist() == [0, 96, 64, 128, 128]
    assert cached_tokens(np.array([512]), np.array([10])).tolist() == [0]


def test_the_mooncake_trace_shares_prefixes_as_its_readme_counts() -> None:
    """../shared/data/README.md: "Prefix-block hit ratio with an unlimited cache: 0.366"."""
    from shared.workloads import prefix_found, read_mooncake_trace

    trace = read_mooncake_trace(DATA / "mooncake_conversation_trace.jsonl")
    assert trace.prefixes is not None and len(trace.prefixes) == 12031
    blocks = [len(p) for p in trace.prefixes]
    assert prefix_found(trace.prefixes, blocks).sum() / sum(blocks) == pytest.approx(
        0.366, abs=5e-4)
    # a cache of 2,000 blocks (a million tokens) keeps far less of it
    assert prefix_found(trace.prefixes, blocks, capacity=2000).sum() / sum(blocks) < 0.1


def test_prompts_that_a_trace_says_share_a_prefix_share_its_tokens(tmp_path: Path) -> None:
    from distserve.commands.replay import trace_requests
    from shared.workloads import read_mooncake_trace

    jsonl = tmp_path / "trace.jsonl"
    rows = [(800, [0, 1]), (800, [0, 1]), (800, [0, 2]), (800, [3, 4])]
    jsonl.write_text("".join(json.dumps({"timestamp": 1000 * i, "input_length": n,
                                         "output_length": 8, "hash_ids": ids}) + "\n"
                             for i, (n, ids) in enumerate(rows)))
    limits = Limits(length_scale=0.125)  # 100-token prompts of 64-token blocks
    w = parse_bench_workload(f"mooncake:{jsonl}", limits)
    assert w.block_tokens == 64 and w.shares_prefixes
    sent = w.requests(1.0, 4)
    prompts = [r.prompt for r in sent]
    assert all(isinstance(p, list) and len(p) == 100 for p in prompts)
    assert prompts[1] == prompts[0]  # the same blocks: the same prompt
    assert prompts[2][:64] == prompts[0][:64] and prompts[2][64:] != prompts[0][64:]
    assert prompts[3][:64] != prompts[0][:64]
    assert w.as_workload().lengths.cached is None  # no cache said: every prompt computed
    assert w.as_workload(None).lengths.cached.tolist() == [0, 96, 64, 0]  # type: ignore[union-attr]
    # a cache of one block keeps a prompt's first (a pool evicts a prefix from its end)
    assert w.as_workload(cache_tokens=64).lengths.cached.tolist() == [0, 64, 64, 0]  # type: ignore[union-attr]
    # `distserve replay` sends the same prompts
    replayed = trace_requests(read_mooncake_trace(jsonl), 1.0, limits)
    assert [r.prompt for r in replayed][:2] == [prompts[0]] * 2
    assert replayed[2].prompt[:64] == prompts[0][:64]
    # a trace without hash_ids (Azure's) shares none, and its prompts differ
    azure = parse_bench_workload(f"azure:{DATA / 'AzureLLMInferenceTrace_conv.csv'}", limits)
    assert not azure.shares_prefixes and azure.as_workload(None).lengths.cached is None
    jsonl.write_text('{"timestamp": 0, "input_length": 5, "output_length": 2, '
                     '"hash_ids": [0, "1"]}\n')
    with pytest.raises(WorkloadError, match="line 1: its hash_ids are not a list of integers"):
        read_mooncake_trace(jsonl)
    jsonl.write_text('{"timestamp": 0, "input_length": 5, "output_length": 2, '
                     '"hash_ids": [0, -1]}\n')
    with pytest.raises(WorkloadError, match="line 1: its hash_ids are not a list of integers"):
        read_mooncake_trace(jsonl)


def test_plan_prices_a_traces_shared_prefixes_only_when_told_the_cache(
        capsys: pytest.CaptureFixture[str]) -> None:
    from distserve.commands.workload_arg import parse_workload

    spec = f"mooncake:{DATA / 'mooncake_conversation_trace.jsonl'}"
    plain = parse_workload(spec, max_context=4096)
    assert plain.lengths.cached is None
    unlimited = parse_workload(spec, max_context=4096, prefix_cache=None)
    assert "an unlimited prefix cache would hold" in capsys.readouterr().err
    bounded = parse_workload(spec, max_context=4096, prefix_cache=20_000)
    assert "one 20000-token prefix cache would hold" in capsys.readouterr().err
    assert len(unlimited.lengths.prompts) == len(plain.lengths.prompts) < 12031
    assert bounded.lengths.cached is not None and unlimited.lengths.cached is not None
    assert 0 < bounded.lengths.cached.mean() < unlimited.lengths.cached.mean()
    # the searches' bounds: what one unlimited cache finds, which no instance's beats
    assert bounded.lengths.mean_cached == unlimited.lengths.mean_cached
    assert np.all(unlimited.lengths.cached < unlimited.lengths.prompts)
    # sent in order at the trace's times: each request its own row's time, of those kept
    timed = parse_workload(spec, replay_arrivals=True, max_context=4096, prefix_cache=None)
    trace = read_trace("mooncake", DATA / "mooncake_conversation_trace.jsonl")
    kept = trace.lengths.prompts + trace.lengths.outputs <= 4096
    assert np.array_equal(timed.trace_times, trace.times_s[kept])  # type: ignore[arg-type]
    for other in (f"azure:{DATA / 'AzureLLMInferenceTrace_conv.csv'}", "fixed:64:8"):
        with pytest.raises(WorkloadError, match="needs a workload that says which prompts"):
            parse_workload(other, prefix_cache=None)


def test_a_chat_workload_is_conversations_whose_turns_grow_their_prompt() -> None:
    from distserve.commands.workload_arg import parse_workload
    from shared.workloads import Chat, parse_chat

    chat = parse_chat("chat:40:20:10:3:2")  # two conversations at once, of three turns
    assert chat == Chat(40, 20, 10, 3, 2)
    assert [chat.turn_of(i) for i in range(8)] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2),
                                                   (1, 2), (2, 0), (3, 0)]
    assert [chat.prompt(t) for t in range(3)] == [60, 90, 120]
    first, second = chat.prefix(0, 0), chat.prefix(0, 1)
    assert len(first) == 4 and len(second) == 6 and second[:4] == first
    assert chat.prefix(1, 0)[:2] == first[:2] and chat.prefix(1, 0)[2:] != first[2:]
    w = parse_bench_workload("chat:40:20:10:3:2", Limits())
    sent = w.requests(2.0, 8)
    assert [r.prompt_tokens for r in sent] == [60, 60, 90, 90, 120, 120, 60, 60]
    assert all(r.max_tokens == 10 for r in sent)
    # a turn's prompt starts with its conversation's earlier one, its answer synthetic;
    # conversations share the system prompt's whole pages (what a cache can share of it)
    assert sent[2].prompt[:60] == sent[0].prompt and sent[4].prompt[:90] == sent[2].prompt
    assert sent[1].prompt[:32] == sent[0].prompt[:32]
    assert sent[1].prompt[32:] != sent[0].prompt[32:]
    # found: the system prompt's two full pages; an earlier turn's full pages
    cached = w.as_workload(None).lengths.cached
    assert cached[:8].tolist() == [0, 32, 48, 48, 80, 80, 32, 32]  # type: ignore[index]
    planned = parse_workload("chat:40:20:10:3:2", prefix_cache=None).lengths
    assert planned.cached[:8].tolist() == cached[:8].tolist()  # type: ignore[index]
    for spec in ("chat:40:20:10", "chat:40:0:10:3", "chat:a:b:c:d", "chat:1:2:3:4:5:6"):
        with pytest.raises(WorkloadError, match="chat:SYSTEM:USER:OUTPUT:TURNS"):
            parse_bench_workload(spec, Limits())
