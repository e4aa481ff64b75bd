"""The relay's rules, pure (a fake clock, no NATS): which chunks reach the client across
moves, and when a request is lost where it is (for the gateway to move it)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from services.gateway.stream import Lost, Relay
from services.gateway.view import InstanceView
from shared.messages import TokenChunk
from shared.state import InstanceInfo


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def beat(view: InstanceView, at: float, *instances: tuple[str, str, int],
         queued: int = 0, held: dict[str, int] | None = None) -> None:
    """Heartbeats of `instances` seen at `at`; each holds attempt 0 of request "r" unless
    `held` says what they hold."""
    for instance_id, role, steps in instances:
        view.observe(InstanceInfo(instance_id=instance_id, role=role,  # type: ignore[arg-type]
                                  steps=steps, queue_len=queued,
                                  held={"r": 0} if held is None else held), at)


def relay(clock: Clock, view: InstanceView | None = None) -> Relay:
    nc: Any = None  # accept and _check never touch NATS
    return Relay(nc, view or InstanceView(2.0), "r", "p0", "d0", stall_s=10.0, clock=clock)


def chunk(seq: int, *tokens: int, source: str = "d0", attempt: int = 0,
          **extra: Any) -> TokenChunk:
    return TokenChunk(request_id="r", seq=seq, token_ids=list(tokens), source=source,
                      attempt=attempt, **extra)


def test_tokens_arrive_in_order_and_repeats_are_dropped() -> None:
    r = relay(Clock())
    assert r.accept(chunk(0, 7, source="p0")) and r.prefilled and r.serving == "d0"
    assert r.accept(chunk(1, 8))
    assert not r.accept(chunk(1, 8))  # a repeat: already relayed
    assert r.accept(chunk(2, 9, finish_reason="stop")) and r.finished
    assert r.output_ids == [7, 8, 9]


def test_a_missing_chunk_is_a_gap() -> None:
    r = relay(Clock())
    r.accept(chunk(0, 7, source="p0"))
    with pytest.raises(Lost) as lost:
        r.accept(chunk(2, 9))
    assert lost.value.cause == "gap" and r.output_ids == [7]


def test_after_a_move_chunks_of_older_attempts_are_dropped() -> None:
    r = relay(Clock())
    r.accept(chunk(0, 7, source="p0"))
    r.accept(chunk(1, 8))
    r.retarget("p0", "d1", prefilled=True)  # d0 died; p0 still held the KV
    assert r.attempt == 1 and r.serving == "d1"
    assert not r.accept(chunk(2, 5, source="d0"))  # d0 was not dead after all: ignored
    assert r.accept(chunk(2, 9, source="d1", attempt=1))
    assert r.output_ids == [7, 8, 9]


def test_a_failed_pull_of_the_current_attempt_loses_the_request() -> None:
    r = relay(Clock())
    r.accept(chunk(0, 7, source="p0"))
    assert not r.accept(chunk(1, source="d0", attempt=5, retry=True, error="x"))  # stale
    with pytest.raises(Lost) as lost:
        r.accept(chunk(1, source="d0", retry=True, error="KV transfer failed"))
    assert lost.value.cause == "kv_transfer"


def test_an_instance_that_stops_heartbeating_loses_its_requests() -> None:
    clock, view = Clock(), InstanceView(2.0)
    beat(view, 0.0, ("p0", "prefill", 0), ("d0", "decode", 0))
    r = relay(clock, view)
    r.accept(chunk(0, 7, source="p0"))
    for t in (1.0, 2.0, 3.0):
        beat(view, t, ("p0", "prefill", 0))  # d0 fell silent
    clock.now = 3.0
    with pytest.raises(Lost) as lost:
        r._check(clock.now)
    assert lost.value.cause == "decode_died"


def test_a_nats_outage_takes_no_instance_for_dead_as_its_peers_come_back_first() -> None:
    """Every heartbeat stops for 2.5 s (nats-server restarting); the decode instance is heard
    again first, the prefill instance a second later: the request prefilling there is not
    lost (it was, `prefill_died`, and prefilled again). One silent for a TTL after the
    silence ended is dead; one that had stopped before it stays dead."""
    clock, view = Clock(), InstanceView(2.0)
    r = relay(clock, view)
    for t in (0.0, 0.5, 1.0):
        beat(view, t, ("p1", "prefill", 0))  # p1 stopped at 1.0: dead by 3.0
    for t in (0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5):
        beat(view, t, ("p0", "prefill", int(2 * t)), ("d0", "decode", 0))
    for t in (6.0, 6.5, 7.0):  # silent 3.5-6.0; d0 back first
        beat(view, t, ("d0", "decode", 0))
        clock.now = t + 0.1
        r._check(clock.now)
        assert view.get("p0", clock.now) is not None
        assert view.get("p1", clock.now) is None  # silent next to p0 before the outage
    beat(view, 7.2, ("p0", "prefill", 8), ("d0", "decode", 0))
    clock.now = 7.3
    r._check(clock.now)
    # the same silence, and p0 never heard again: dead a TTL after the silence ended
    view = InstanceView(2.0)
    for t in (0.0, 0.5, 1.0):
        beat(view, t, ("p0", "prefill", 0), ("d0", "decode", 0))
    for t in (4.0, 4.5, 5.0, 5.5, 6.0, 6.5):
        beat(view, t, ("d0", "decode", 0))
    assert view.get("p0", 5.9) is not None and view.get("p0", 6.1) is None
    r = relay(clock, view)
    clock.now = 6.5
    with pytest.raises(Lost) as lost:
        r._check(clock.now)
    assert lost.value.cause == "prefill_died"
    # a silence shorter than the TTL (1.5 s), p0 back a second after d0: not dead either
    view = InstanceView(2.0)
    for t in (0.0, 0.5, 1.0):
        beat(view, t, ("p0", "prefill", 0), ("d0", "decode", 0))
    for t in (2.5, 3.0, 3.5):
        beat(view, t, ("d0", "decode", 0))
    assert view.get("p0", 3.6) is not None
    beat(view, 3.6, ("p0", "prefill", 0))
    assert view.get("p0", 4.0) is not None


def test_a_request_queued_on_a_busy_instance_is_not_lost_but_a_stalled_one_is() -> None:
    clock, view = Clock(), InstanceView(2.0)
    r = relay(clock, view)
    for t in range(0, 30):  # p0 steps through others' prompts, ours queued: progress
        beat(view, float(t), ("p0", "prefill", t), ("d0", "decode", 0), queued=3)
        clock.now = float(t)
        r._check(clock.now)
    for t in range(30, 45):  # p0 heartbeats but no longer steps
        beat(view, float(t), ("p0", "prefill", 30), ("d0", "decode", 0), queued=3)
        clock.now = float(t)
        if t - 30 > 10:
            with pytest.raises(Lost, match="no progress"):
                r._check(clock.now)
            return
        r._check(clock.now)
    raise AssertionError("never stalled")


def test_a_prefill_instance_whose_pool_waits_on_pulls_is_not_stalled() -> None:
    """Its steps stop while its pool is full of KV the decode side has not pulled yet, but
    it keeps trying (stalled_steps): the request queued there is not moved."""
    clock, view = Clock(), InstanceView(2.0)
    r = relay(clock, view)
    for t in range(0, 30):
        view.observe(InstanceInfo(instance_id="p0", role="prefill", steps=5, stalled_steps=t,
                                  queue_len=3, held={"r": 0}), float(t))
        beat(view, float(t), ("d0", "decode", t))
        clock.now = float(t)
        r._check(clock.now)  # 30 s without a step, never Lost


def test_a_decode_instance_that_never_started_it_waits_for_the_kv_holder() -> None:
    """Announced to d0 (prefilled on p0), d0 said nothing yet and p0 died: after a grace
    (d0's pull would fail anyway) the request is lost, for a prefill again elsewhere."""
    clock, view = Clock(), InstanceView(2.0)
    beat(view, 0.0, ("p0", "prefill", 1), ("d0", "decode", 1))
    r = relay(clock, view)
    r.accept(chunk(0, 7, source="p0"))
    lost_at = None
    for t in range(1, 12):
        beat(view, float(t), ("d0", "decode", 1 + t))  # d0 busy with others; p0 silent
        clock.now = float(t)
        try:
            r._check(clock.now)
        except Lost as lost:
            assert lost.cause == "prefill_died"
            lost_at = t
            break
    assert lost_at is not None and lost_at > 3  # p0 silent past its ttl, then the grace


def test_a_running_request_whose_chunks_stop_while_its_instance_steps_is_lost() -> None:
    """The last chunks (the finish among them) went missing: the decode instance goes on
    stepping for others, so it never looks stalled; its steps without a token tell."""
    clock, view = Clock(), InstanceView(2.0)
    beat(view, 0.0, ("p0", "prefill", 1), ("d0", "decode", 10))
    r = relay(clock, view)
    r.accept(chunk(0, 7, source="p0"))
    r.accept(chunk(1, 8))
    r._check(0.0)  # the count starts at d0's 10 steps
    beat(view, 1.0, ("p0", "prefill", 1), ("d0", "decode", 10 + 64))
    r._check(1.0)  # 64 steps: still within the bound
    beat(view, 2.0, ("p0", "prefill", 1), ("d0", "decode", 10 + 65))
    with pytest.raises(Lost) as lost:
        r._check(2.0)
    assert lost.value.cause == "gap"


@pytest.mark.parametrize("heard", [False, True])
def test_a_request_its_instance_no_longer_holds_is_lost(heard: bool) -> None:
    """Every chunk a decode instance sent went missing (a NATS outage as it ran a short
    request to its end): d0 steps on for others, so the request never stalls, and nothing
    came of it to show a gap. d0's heartbeats no longer list it: once they have not for
    `absent_s`, it is lost. Listed (queued there, pulled, running) it waits; an older
    attempt listed is not this one."""
    clock, view = Clock(), InstanceView(2.0)
    beat(view, 0.0, ("p0", "prefill", 1), ("d0", "decode", 10))
    r = relay(clock, view)
    r.accept(chunk(0, 7, source="p0"))
    if heard:
        r.accept(chunk(1, 8))
    for t in range(1, 20):  # held, though silent, for 19 s: not lost
        beat(view, float(t), ("p0", "prefill", 1), ("d0", "decode", 10 + t))
        r._check(float(t))
    lost_at = None
    for t in range(20, 40):  # d0 holds only an older attempt of it, then nothing
        beat(view, float(t), ("p0", "prefill", 1), ("d0", "decode", 10 + t),
              held={"r": -1} if t < 25 else {})
        try:
            r._check(float(t))
        except Lost as lost:
            assert lost.cause == "gap" and "does not hold attempt 0 of r" in str(lost)
            lost_at = t
            break
    assert lost_at is not None and 20 + r.absent_s < lost_at <= 20 + r.absent_s + 1


def test_a_request_on_a_decode_instance_that_preempted_some_is_not_lost() -> None:
    clock, view = Clock(), InstanceView(2.0)
    r = relay(clock, view)
    r.accept(chunk(0, 7, source="p0"))
    r.accept(chunk(1, 8))
    for t in range(1, 6):  # d0 steps on with requests preempted: ours may be one of them
        view.observe(InstanceInfo(instance_id="d0", role="decode", steps=100 * t,
                                  preempted=2, held={"r": 0}), float(t))
        beat(view, float(t), ("p0", "prefill", 1))
        r._check(float(t))


def test_an_attempt_its_worker_never_acknowledged_is_lost_at_the_next_read() -> None:
    """The gateway's `deliver` got no acknowledgement (the request lost as NATS
    reconnected): the relay's next read says so at once, for the gateway to move the
    request, and the attempt after that reads as any other."""
    r = relay(Clock())
    r.undelivered("p0 never acknowledged attempt 0 of r (3 tries: nats: timeout)")

    async def read() -> Lost:
        with pytest.raises(Lost) as lost:
            await r.next()
        return lost.value

    lost = asyncio.run(read())
    assert lost.cause == "undelivered" and "never acknowledged" in str(lost)
    r.retarget("p1", "d0", prefilled=False)
    r._queue.put_nowait(chunk(0, 7, source="p1", attempt=r.attempt))
    assert asyncio.run(r.next()).token_ids == [7]


def test_a_stream_leaves_a_stuck_decode_instance_only_for_one_that_is_not() -> None:
    """d0's engine wedges (its heartbeats go on, its steps stop): past stuck_s its streams
    move where another decode instance serves, without waiting out stall_s. Alone, beside
    only stuck or draining ones, as a prefill instance, or at a step that computes prompt
    tokens (a recompute after preemption: long by rights) they wait out stall_s."""
    def info(instance_id: str, role: str, stuck_since: float, at: float,
             draining: bool = False, prompts: bool = False) -> InstanceInfo:
        return InstanceInfo(instance_id=instance_id, role=role,  # type: ignore[arg-type]
                            steps=5, held={"r": 0}, stuck_since=stuck_since,
                            heartbeat_at=1000.0 + at, draining=draining,
                            stuck_on_prompts=prompts)

    def lost_at(others: list[tuple[str, float, bool]], stuck_s: float | None = 5.0,
                serving: str = "d0", prompts: bool = False) -> tuple[float, str]:
        """When (and why) the stream on `serving`, wedged at 1000 on its clock, is lost;
        `others`: decode instances (id, stuck since, draining)."""
        clock, view = Clock(), InstanceView(2.0)
        r = Relay(None, view, "r", "p0", "d0", stall_s=30.0, clock=clock,  # type: ignore[arg-type]
                  stuck_s=stuck_s)
        if serving == "d0":
            r.accept(chunk(0, 7, source="p0"))
            r.accept(chunk(1, 8))
        for t in range(40):
            clock.now = float(t)
            view.observe(info("p0", "prefill", 1000.0 if serving == "p0" else 0.0, t), t)
            view.observe(info("d0", "decode", 1000.0 if serving == "d0" else 0.0, t,
                              prompts=prompts), t)
            for instance_id, since, draining in others:
                view.observe(info(instance_id, "decode", since, t, draining), t)
            try:
                r._check(clock.now)
            except Lost as lost:
                return clock.now, lost.cause
        raise AssertionError("never lost")

    assert lost_at([("d1", 0.0, False)]) == (6.0, "stuck")  # stuck for 6 s > 5
    assert lost_at([]) == (31.0, "stalled")  # nowhere else to go
    assert lost_at([("d1", 1000.0, False)]) == (31.0, "stalled")  # d1 as stuck
    assert lost_at([("d1", 0.0, True)]) == (31.0, "stalled")  # d1 leaving
    assert lost_at([("d1", 0.0, False)], stuck_s=None) == (31.0, "stalled")
    assert lost_at([("d1", 0.0, False)], serving="p0") == (31.0, "stalled")
    assert lost_at([("d1", 0.0, False)], prompts=True) == (31.0, "stalled")
