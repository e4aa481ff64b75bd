"""What a service logs while NATS is down (shared/bus.py's connection): a line per distinct
error at most every 30 s, one for the disconnect and one for the reconnect, no traceback (it
logged one per reconnect attempt, ~4 a second, in every process); and a message that must
arrive, sent until its subscriber acknowledges it."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest
from nats.aio.msg import Msg

from services.launcher import nats_server_binary
from services.supervisor import Supervisor, free_port, wait_for_port
from shared.bus import Repeats, acknowledge, connect, deliver
from shared.messages import Cancel

pytestmark = pytest.mark.timeout(60)


def test_a_message_is_said_again_only_once_its_interval_has_passed() -> None:
    repeats = Repeats(every_s=30.0)
    assert [repeats.fresh("refused", t) for t in (0.0, 0.5, 29.9, 30.0, 31.0)] == \
        [True, False, False, True, False]
    assert repeats.fresh("timed out", 31.0)  # another message is news
    assert set(repeats.said) == {"refused", "timed out"}
    repeats.fresh("refused", 100.0)
    assert set(repeats.said) == {"refused"}  # those past their interval are forgotten


def test_a_nats_outage_logs_a_few_lines_and_no_traceback(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    port = free_port()
    argv = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)]

    async def outage(supervisor: Supervisor) -> None:
        nc = await connect(f"nats://127.0.0.1:{port}", "test")
        supervisor.proc("nats").kill()
        await asyncio.sleep(3)  # ~6 reconnect attempts, each refused
        await asyncio.to_thread(wait_for_port, port, supervisor.spawn("nats-again", argv),
                                "nats")
        deadline = time.monotonic() + 20
        while not nc.is_connected:
            assert time.monotonic() < deadline, "never reconnected"
            await asyncio.sleep(0.1)
        await nc.close()

    with Supervisor(tmp_path) as supervisor:
        wait_for_port(port, supervisor.spawn("nats", argv), "nats")
        asyncio.run(outage(supervisor))
    said = [r for r in caplog.records if r.name.startswith(("nats", "shared.bus"))]
    assert all(r.exc_info is None for r in said), [r.getMessage() for r in said]
    messages = [r.getMessage() for r in said]
    assert messages.count("nats (test): disconnected; reconnecting") == 1, messages
    assert messages[-1] == "nats (test): reconnected", messages
    errors = [m for m in messages if not m.endswith(("disconnected; reconnecting",
                                                     "reconnected"))]
    # the lost connection's error, then the refused attempts' (each a line of its own)
    assert 1 <= len(errors) == len(set(errors)) <= 3, messages
    assert any("ConnectionRefusedError: " in e for e in errors), messages


def test_a_message_that_must_arrive_is_sent_again_until_acknowledged(nats_url: str) -> None:
    """`deliver` against a real nats-server: a subscriber that lets the first copy go
    unanswered (as a message lost while the connection dropped would be) gets it again and
    acknowledges it; one that never answers, or no subscriber at all, is said to be so after
    the tries."""
    async def main() -> None:
        nc = await connect(nats_url, "test")
        got: list[bytes] = []

        async def second_time(msg: Msg) -> None:
            got.append(msg.data)
            if len(got) > 1:
                await acknowledge(msg)

        async def mute(msg: Msg) -> None:
            pass

        await nc.subscribe("ds.test.late", cb=second_time)
        await nc.subscribe("ds.test.mute", cb=mute)
        await nc.flush()
        message = Cancel(request_id="r1")
        assert await deliver(nc, "ds.test.late", message, tries=3, try_s=0.3) is None
        assert [Cancel.model_validate_json(data) for data in got] == [message] * 2
        began = time.monotonic()
        assert await deliver(nc, "ds.test.mute", message, tries=2, try_s=0.3) is not None
        assert time.monotonic() - began >= 0.6
        assert await deliver(nc, "ds.test.nobody", message, tries=2,
                             try_s=0.3) == "no subscriber"
        await nc.close()

    asyncio.run(main())
