"""Each simulated instance's prefix cache (simulator/prefixes.py): an instance finds only
what the requests dispatched to it left, and dispatch leans toward where a prompt's start
went, as the gateway's does."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from distserve.commands.workload_arg import parse_workload
from services.planner.latency import LatencyModel, PhaseCoefficients
from services.planner.simulator import (
    ColocatedCluster,
    DisaggregatedCluster,
    InstanceSpec,
    Link,
    SimResult,
    simulate_colocated,
    simulate_disaggregated,
)
from shared.workloads import (
    NO_CACHE,
    POOL_CACHE,
    Chat,
    PrefixCaching,
    Workload,
    WorkloadRequest,
    cached_in,
)

CHAT = Chat(system=64, user=32, output=16, turns=4, active=2)
COEFFS = PhaseCoefficients((10.0, 0.1, 0.0), (10.0, 0.001, 0.05), (10.0, 0.001, 0.05))


def spec(kv_capacity: int = 10**6) -> InstanceSpec:
    return InstanceSpec(LatencyModel(COEFFS), kv_capacity, max_batch_tokens=4096)


def chat_requests(n: int, gap_s: float, cache_tokens: int | None = None
                  ) -> list[WorkloadRequest]:
    """`n` turns of CHAT `gap_s` apart, each instance caching them in `cache_tokens`."""
    lengths, prefixes = CHAT.lengths(n)
    caching = PrefixCaching(16, cache_tokens)
    return [WorkloadRequest(i * gap_s, int(p), int(o), 0, prefixes[i], caching)
            for i, (p, o) in enumerate(zip(lengths.prompts, lengths.outputs, strict=True))]


def per_instance(result: SimResult, requests: list[WorkloadRequest]) -> list[int]:
    """What each request finds, counted apart: `cached_in` over the requests each instance
    was sent, in order."""
    found = [0] * len(requests)
    for instance in {r.instance for r in result.requests}:
        mine = [r.rid for r in result.requests if r.instance == instance]
        counted = cached_in([requests[i].prefix for i in mine],
                            np.array([requests[i].prompt_tokens for i in mine]), 16, None)
        for i, c in zip(mine, counted, strict=True):
            found[i] = int(c)
    return found


def one_cache(requests: list[WorkloadRequest]) -> list[int]:
    return cached_in([r.prefix for r in requests],
                     np.array([r.prompt_tokens for r in requests]), 16, None).tolist()


@pytest.mark.parametrize("mode", ["colocated", "chunked", "disaggregated"])
def test_requests_spread_over_instances_find_only_what_their_own_instance_kept(
        mode: str) -> None:
    """Sent at once, a conversation's turns go wherever the load is least: two instances
    each miss what the other was sent, and each request finds exactly what the requests
    before it on its instance left."""
    requests = chat_requests(16, 0.0)
    if mode == "disaggregated":
        result = simulate_disaggregated(
            DisaggregatedCluster([spec(), spec()], [spec()], Link(1)), requests)
    else:
        result = simulate_colocated(ColocatedCluster([spec(), spec()], mode == "chunked"),
                                    requests)
    assert {r.instance for r in result.requests} == {0, 1}
    found = [r.cached for r in result.requests]
    assert found == per_instance(result, requests)
    assert sum(found) < sum(one_cache(requests))  # one cache would have held more
    assert all(r.done for r in result.requests)


def test_an_idle_cluster_sends_a_prompt_where_its_start_went() -> None:
    """Far apart, every instance is idle when a request comes: the tie goes to the one its
    prompt's start went to (the shared system prompt's), so one cache finds all it would
    alone, while without the lean toward it requests go to the first instance anyway."""
    requests = chat_requests(16, 100.0)
    result = simulate_colocated(ColocatedCluster([spec(), spec()]), requests)
    assert {r.instance for r in result.requests} == {0}
    assert [r.cached for r in result.requests] == one_cache(requests)


def test_a_conversation_stays_on_the_instance_that_holds_it() -> None:
    """A request sent where another is busy goes to the other instance; the conversation's
    next turn, sent when both are idle, goes back to where its start went."""
    requests = chat_requests(3, 0.0)
    # turn 0 of conversations 0 and 1 at once (two instances), then conversation 1's next
    # turn when all is quiet: it goes to instance 1, which holds its start
    requests = [requests[0], requests[1],
                dataclasses.replace(chat_requests(4, 0.0)[3], arrival_s=100.0)]
    result = simulate_colocated(ColocatedCluster([spec(), spec()]), requests)
    assert [r.instance for r in result.requests] == [0, 1, 1]
    assert result.requests[2].cached == requests[1].prompt_tokens // 16 * 16


def test_a_turn_stays_with_its_cache_while_its_last_answer_streams() -> None:
    """A colocated worker takes a conversation's next turn while it still decodes the turn
    before (one request more than the idle other: within the slack), and finds that turn's
    prompt cached; not while it decodes two (past the slack)."""
    requests = chat_requests(8, 0.0)
    sent = [dataclasses.replace(requests[0], output_tokens=1),  # done at once, instance 0
            dataclasses.replace(requests[1], output_tokens=400),  # decodes for seconds, 1
            dataclasses.replace(requests[3], arrival_s=1.0),  # its next turn
            dataclasses.replace(requests[5], arrival_s=1.05)]  # and the one after
    result = simulate_colocated(ColocatedCluster([spec(), spec()]), sent)
    assert [r.instance for r in result.requests] == [0, 1, 1, 0]
    assert result.requests[2].cached == requests[1].prompt_tokens // 16 * 16


def test_a_prefill_instance_takes_a_turn_while_its_queue_is_worth_the_wait() -> None:
    """Two prefill instances: a conversation's turns go to the one that holds its start
    while the prompt tokens queued there, less what it holds, are no more than the other's
    (two turns at once both go there, as ties alone would not send them); a long prompt of
    the conversation's queued there sends the next turn to the other instance."""
    requests = chat_requests(8, 0.0)
    cluster = DisaggregatedCluster([spec(), spec()], [spec()], Link(1))
    starts = requests[:2]  # conversation 0's first turn to instance 0, 1's to 1
    turns = [dataclasses.replace(requests[i], arrival_s=10.0) for i in (3, 5)]
    result = simulate_disaggregated(cluster, [*starts, *turns])
    assert [r.instance for r in result.requests] == [0, 1, 1, 1]
    assert [r.cached for r in result.requests[2:]] == \
        [r.prompt_tokens // 16 * 16 for r in (requests[1], requests[3])]
    long = requests[1].prefix + tuple(range(1 << 30, (1 << 30) + 120))  # 2,000 tokens more
    queued = WorkloadRequest(10.0, 16 * len(long), 1, 0, long, requests[1].caching)
    result = simulate_disaggregated(cluster, [*starts, queued, turns[0]])
    assert [r.instance for r in result.requests] == [0, 1, 1, 0]


def test_an_instance_keeps_as_many_blocks_as_its_cache_holds() -> None:
    """POOL_CACHE: each instance's cache is its KV pool. A pool of 64 tokens keeps only the
    last prompt's first blocks; an unlimited one, all."""
    requests = chat_requests(8, 100.0, POOL_CACHE)
    small = simulate_colocated(ColocatedCluster([spec(kv_capacity=256)]), requests)
    roomy = simulate_colocated(ColocatedCluster([spec()]), requests)
    assert 0 < small.cached_share < roomy.cached_share
    assert [r.cached for r in roomy.requests] == one_cache(requests)


def test_one_instance_finds_what_its_workload_counted_for_a_cache_its_size() -> None:
    """A workload counts what one cache of its size finds, its prompts in order; one
    instance with such a cache is simulated with those counts, and counting them again in
    the simulation gives the same, past the workload's end too (its prompts again as new
    ones)."""
    workload = parse_workload("chat:64:32:16:4:2", prefix_cache=400)
    requests = workload.requests(1.0, 2 * 1024 + 5, seed=0)
    assert requests[1024].prefix != requests[0].prefix  # renamed: a new conversation
    assert requests[1024].prompt_tokens == requests[0].prompt_tokens
    assert requests[0].caching == PrefixCaching(16, 400, 400)
    recount = [dataclasses.replace(r, cached_tokens=0, caching=dataclasses.replace(
        r.caching, counted=NO_CACHE)) for r in requests]  # type: ignore[arg-type]
    for cluster in (ColocatedCluster([spec()]), ColocatedCluster([spec()], chunked=True)):
        counted, simulated = (simulate_colocated(cluster, w) for w in (requests, recount))
        assert [r.cached for r in counted.requests] == [r.cached for r in simulated.requests]
        assert counted.cached_share > 0.5


def test_a_workload_with_prefixes_comes_in_order_and_one_without_is_drawn() -> None:
    ordered = parse_workload("chat:64:32:16:4:2", prefix_cache=None)
    assert [r.prompt_tokens for r in ordered.requests(1.0, 8)] == \
        CHAT.lengths(8)[0].prompts.tolist() == [96, 96, 144, 144, 192, 192, 240, 240]
    assert isinstance(ordered, Workload)
    drawn = parse_workload("chat:64:32:16:4:2")
    assert drawn.lengths.caching is None and drawn.lengths.prefixes is None
    assert [r.prompt_tokens for r in drawn.requests(1.0, 8)] != \
        CHAT.lengths(8)[0].prompts.tolist()
