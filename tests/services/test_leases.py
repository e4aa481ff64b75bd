"""Gateway leases: when a worker takes a gateway for gone (pure, an injected clock), reading
the leases in a real Valkey, a colocated worker cancelling a gone gateway's requests only,
and a gateway that stops leaving no key behind (real NATS and Valkey, a tiny engine)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from redis.asyncio import Redis

from services.colocated.service import ColocatedService
from services.gateway.gateway import Gateway, GatewaySettings
from services.leases import GatewayLeases, read_leases
from services.process import WorkerSettings
from services.supervisor import free_port
from shared import subjects
from shared.bus import publish
from shared.engine.config import EngineConfig, Role
from shared.engine.engine import Engine
from shared.messages import PrefillRequest, Sampling
from tests.services.test_worker import engine_held, until, until_idle, worker_serving


def test_a_gateway_is_gone_once_its_key_was_read_absent_for_the_whole_lease() -> None:
    leases = GatewayLeases(lease_s=10)
    assert leases.observe({"a": True, "b": False}, 0.0) == {}
    assert leases.observe({"a": False, "b": False}, 9.0) == {}
    assert leases.observe({"a": False, "b": False}, 10.0) == {"b": 10.0}
    assert leases.observe({"a": False, "b": False}, 19.5) == {"a": 10.5, "b": 19.5}


def test_a_key_found_again_starts_the_count_again() -> None:
    leases = GatewayLeases(lease_s=10)
    leases.observe({"a": False}, 0.0)
    assert leases.observe({"a": True}, 8.0) == {}  # a gateway slow to write, not dead
    assert leases.observe({"a": False}, 9.0) == {}
    assert leases.observe({"a": False}, 18.0) == {}
    assert leases.observe({"a": False}, 19.0) == {"a": 10.0}


def test_a_failed_reading_never_makes_a_gateway_gone() -> None:
    """Redis down for 30 s, then back without the key for a moment (a Valkey restart loses
    every key until each gateway writes its own again): absence is counted from readings
    that said so, after the outage only."""
    leases = GatewayLeases(lease_s=10)
    leases.observe({"a": False}, 0.0)
    for t in range(2, 32, 2):
        assert leases.observe({"a": None}, float(t)) == {}
    assert leases.observe({"a": False}, 32.0) == {}
    assert leases.observe({"a": True}, 33.0) == {}
    leases.observe({"a": False}, 40.0)
    assert leases.observe({"a": None}, 49.0) == {}  # one failure in the lease: again
    assert leases.observe({"a": False}, 50.0) == {}
    assert leases.observe({"a": False}, 60.0) == {"a": 10.0}


def test_a_gateway_no_longer_held_is_forgotten() -> None:
    leases = GatewayLeases(lease_s=10)
    leases.observe({"a": False}, 0.0)
    assert leases.observe({}, 5.0) == {}  # its requests ended
    assert leases.observe({"a": False}, 12.0) == {}  # a request of it came back: anew
    assert leases.observe({"a": False}, 22.0) == {"a": 10.0}


@pytest.mark.timeout(60)
def test_leases_are_read_in_redis_and_unknown_where_it_does_not_answer_or_take_writes(
        redis_url: str) -> None:
    async def main() -> None:
        redis = Redis.from_url(redis_url)
        await redis.set(subjects.gateway_key("gw-here"), 1)
        assert await read_leases(redis, {"gw-here", "gw-gone"}) == {"gw-here": True,
                                                                   "gw-gone": False}
        assert await read_leases(redis, set()) == {}
        # a Redis that serves reads but refuses writes (here: too few replicas) lets every
        # lease lapse while its gateway lives: its readings say nothing
        await redis.config_set("min-replicas-to-write", 1)
        try:
            assert await redis.get(subjects.gateway_key("gw-here")) is not None
            assert await read_leases(redis, {"gw-here", "gw-gone"}, "decode-0") == {
                "gw-here": None, "gw-gone": None}
        finally:
            await redis.config_set("min-replicas-to-write", 0)
        assert (await read_leases(redis, {"gw-gone"}, "decode-0")) == {"gw-gone": False}
        await redis.aclose()
        nobody = Redis.from_url(f"redis://127.0.0.1:{free_port()}", socket_connect_timeout=1)
        assert await read_leases(nobody, {"gw-here"}) == {"gw-here": None}
        await nobody.aclose()

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_a_worker_cancels_the_requests_of_a_gateway_gone_and_only_those(
        nats_url: str, redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """Three requests wait to be taken in (the engine thread busy): one of a gateway whose
    lease is absent, one of a gateway that holds its lease, one that names no gateway. Only
    the first is cancelled, as a client's cancel would drop it; the others run to their
    end."""
    settings = WorkerSettings(instance_id="colocated-g", nats_url=nats_url, redis_url=redis_url,
                              model="tiny", heartbeat_s=0.1, gateway_lease_s=0.5)
    config = EngineConfig(model="tiny", device="cpu").with_scheduler(role=Role.COLOCATED)
    worker = ColocatedService(settings, Engine(config))
    origins = {"orphan": "gw-dead", "kept": "gw-alive", "unnamed": ""}
    caplog.set_level(logging.WARNING, logger="services.runtime")

    async def main() -> None:
        redis = Redis.from_url(redis_url)
        await redis.set(subjects.gateway_key("gw-alive"), 1, px=60_000)
        async with worker_serving(worker, nats_url, redis_url, list(origins)) as (nc, seen):
            async with engine_held(worker):
                for request_id, gateway in origins.items():
                    await publish(nc, subjects.prefill("colocated-g"), PrefillRequest(
                        request_id=request_id, prompt_ids=[1, 2, 3], gateway=gateway,
                        sampling=Sampling(max_tokens=8, ignore_eos=True),
                        arrival_ts=time.time()))
                await until(lambda: set(origins) <= worker.known.keys())
                await until(lambda: "orphan" not in worker.known)  # lease, then a reading
                assert worker.known.keys() == {"kept", "unnamed"}
            await until(lambda: sum(c.finish_reason == "length" for c in seen) == 2)
            await until_idle(worker)
            assert {c.request_id for c in seen} == {"kept", "unnamed"}  # none of the orphan
            assert "orphan" in worker.cancelled
        await redis.aclose()

    asyncio.run(main())
    gone = [r.getMessage() for r in caplog.records if "is gone" in r.getMessage()]
    assert len(gone) == 1 and "gateway gw-dead is gone (no heartbeat for" in gone[0]
    assert gone[0].endswith("cancelled 1 requests")


@pytest.mark.timeout(120)
def test_a_gateway_holds_its_lease_while_it_runs_and_leaves_no_key_when_it_stops(
        nats_url: str, redis_url: str) -> None:
    """Its in-flight counts too: a draining worker waits for them (they used to linger their
    5 s expiry after a clean stop). A fixed id is leased under a name of this incarnation."""
    gateway = Gateway(GatewaySettings(nats_url=nats_url, redis_url=redis_url, gateway_id="g1"))
    assert gateway.lease.startswith("g1.") and gateway.lease != "g1"

    async def main() -> None:
        redis = Redis.from_url(redis_url)
        await gateway.start()
        gateway.ledger.book("prefill-x", "decode-x")
        lease = subjects.gateway_key(gateway.lease)
        counts = [subjects.inflight_key(i, "g1") for i in ("prefill-x", "decode-x")]
        deadline = time.monotonic() + 30
        while await redis.exists(lease, *counts) < 3:
            assert time.monotonic() < deadline, "the gateway never wrote its keys"
            await asyncio.sleep(0.1)
        assert 0 < await redis.pttl(lease) <= 5000
        await redis.set(subjects.inflight_key("decode-x", "other"), 1)  # another gateway's
        await gateway.stop()
        assert await redis.exists(lease, *counts) == 0
        assert await redis.exists(subjects.inflight_key("decode-x", "other")) == 1
        await redis.aclose()

    asyncio.run(main())
