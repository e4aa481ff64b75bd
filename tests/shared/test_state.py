"""The instance registry against a real Redis-protocol server (Valkey)."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

from shared import subjects
from shared.state import (
    InstanceInfo,
    Registry,
    others_in_flight,
    pick_colocated,
    pick_decode,
    pick_prefill,
)


def info(name: str, role: str = "prefill", **load: int | bool) -> InstanceInfo:
    return InstanceInfo(instance_id=name, role=role, **load)  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_heartbeats_register_and_expire(redis_url: str) -> None:
    async def main() -> None:
        redis = Redis.from_url(redis_url)
        registry = Registry(redis, ttl_s=0.5)
        await registry.heartbeat(info("p0", queue_len=3))
        await registry.heartbeat(info("p1", queue_len=1))
        await registry.heartbeat(info("d0", "decode", free_blocks=10))
        live = await registry.instances("prefill")
        assert [i.instance_id for i in live] == ["p0", "p1"]
        assert all(i.heartbeat_at > 0 for i in live)
        chosen = pick_prefill(live)
        assert chosen is not None and chosen.instance_id == "p1"
        for _ in range(4):  # p0 keeps beating, p1 stops
            await asyncio.sleep(0.2)
            await registry.heartbeat(info("p0", queue_len=3))
        assert [i.instance_id for i in await registry.instances("prefill")] == ["p0"]
        assert await redis.smembers("ds:instances:prefill") == {b"p0"}  # cleaned up
        await registry.remove("p0", "prefill")
        assert await registry.instances("prefill") == []
        await redis.aclose()

    asyncio.run(main())


def test_dispatch_rules() -> None:
    decodes = [info("d0", "decode", free_blocks=5, running=1),
               info("d1", "decode", free_blocks=9, running=7),
               info("d2", "decode", free_blocks=50, running=0, draining=True)]
    chosen = pick_decode(decodes)
    assert chosen is not None and chosen.instance_id == "d1"  # most free blocks, not draining
    assert pick_prefill([]) is None
    prefills = [info("a", queue_len=2), info("b", queue_len=2, running=1), info("c", queue_len=4)]
    chosen = pick_prefill(prefills)
    assert chosen is not None and chosen.instance_id == "a"


def test_prefill_dispatch_counts_each_request_not_yet_prefilled_once() -> None:
    """a queues 2 of this gateway's requests, b 3 of another gateway's, both in their
    heartbeats: a is the shorter queue (its heartbeat's 2 are the 2 this gateway has in
    flight there, not 2 more); a burst of this gateway's own then tips it to b. Without the
    other gateways' counts, b's heartbeat still counts."""
    prefills = [info("a", queue_len=2), info("b", queue_len=3)]
    elsewhere = {"b": 3}
    chosen = pick_prefill(prefills, {"a": 2}, elsewhere)
    assert chosen is not None and chosen.instance_id == "a"
    chosen = pick_prefill(prefills, {"a": 4}, elsewhere)
    assert chosen is not None and chosen.instance_id == "b"
    chosen = pick_prefill(prefills, {"a": 3}, elsewhere)  # a tie: the heartbeats' queues
    assert chosen is not None and chosen.instance_id == "a"
    # the other gateway's counts cannot be read (Redis down): b's heartbeat still shows them
    chosen = pick_prefill(prefills, {"a": 2}, {})
    assert chosen is not None and chosen.instance_id == "a"


def test_colocated_dispatch_counts_what_is_in_flight_then_what_awaits_a_first_token() -> None:
    """Two workers with one request each: the new one goes where that request is already
    decoding, not where it still waits for its prefill (it would queue behind it), whatever
    the stale heartbeats say; other gateways' requests count as their gateways publish
    them, and keep counting as this gateway's own grow."""
    workers = [info("c0", "colocated", running=1), info("c1", "colocated")]
    mine, queued = {"c0": 1, "c1": 1}, {"c0": 1, "c1": 0}
    chosen = pick_colocated(workers, mine, queued)
    assert chosen is not None and chosen.instance_id == "c1"
    chosen = pick_colocated(workers, mine, {})  # a tie throughout: by id
    assert chosen is not None and chosen.instance_id == "c0"
    # a heartbeat that still counts a request this gateway saw finish does not
    stale = [info("c0", "colocated", running=2), info("c1", "colocated", running=1)]
    chosen = pick_colocated(stale, {"c0": 1, "c1": 1}, {})
    assert chosen is not None and chosen.instance_id == "c0"
    # c0 holds 4, 3 of them another gateway's; then this gateway's burst onto c1 tips it
    elsewhere = {"c0": 3}
    chosen = pick_colocated(workers, {"c0": 1, "c1": 2}, {}, elsewhere)
    assert chosen is not None and chosen.instance_id == "c1"
    chosen = pick_colocated(workers, {"c0": 1, "c1": 5}, {}, elsewhere)
    assert chosen is not None and chosen.instance_id == "c0"
    draining = [info("c0", "colocated", draining=True), info("c1", "colocated", running=5)]
    chosen = pick_colocated(draining, {}, {})
    assert chosen is not None and chosen.instance_id == "c1"
    assert pick_colocated([], {}, {}) is None


@pytest.mark.timeout(60)
def test_a_gateway_reads_the_other_gateways_in_flight_counts(redis_url: str) -> None:
    async def main() -> None:
        redis = Redis.from_url(redis_url)
        for instance, gateway, n in (("colocated-0", "gateway-a", 2),
                                     ("colocated-0", "gateway-b", 3),
                                     ("colocated-1", "gateway-b", 1),
                                     ("colocated-1", "gateway-c", 4)):
            await redis.set(subjects.inflight_key(instance, gateway), n, px=5000)
        assert await others_in_flight(redis, "gateway-a") == {"colocated-0": 3,
                                                               "colocated-1": 5}
        assert await others_in_flight(redis, "gateway-b") == {"colocated-0": 2,
                                                               "colocated-1": 4}
        await redis.set(subjects.inflight_key("colocated-1", "gateway-c"), 4, px=50)
        await asyncio.sleep(0.2)  # gateway-c died: its count expires with it
        assert await others_in_flight(redis, "gateway-a") == {"colocated-0": 3,
                                                               "colocated-1": 1}
        await redis.aclose()

    asyncio.run(main())


def test_a_prompt_goes_where_its_start_went_only_among_the_least_loaded() -> None:
    prefills = [info("a"), info("b"), info("c", queue_len=1)]
    chosen = pick_prefill(prefills, prefer="b")
    assert chosen is not None and chosen.instance_id == "b"  # a tie: its prefix is there
    chosen = pick_prefill(prefills, {"b": 1}, prefer="b")
    assert chosen is not None and chosen.instance_id == "a"  # busier: the load decides
    chosen = pick_prefill(prefills, prefer="c")
    assert chosen is not None and chosen.instance_id == "a"
    workers = [info("w0", "colocated"), info("w1", "colocated")]
    chosen = pick_colocated(workers, {}, {}, prefer="w1")
    assert chosen is not None and chosen.instance_id == "w1"
    chosen = pick_colocated(workers, {}, {"w1": 1}, prefer="w1")  # a prompt waits there
    assert chosen is not None and chosen.instance_id == "w0"
