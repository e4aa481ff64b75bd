"""NATS helpers: connect (saying what happens to the connection in one line each, not a
traceback per reconnect attempt), publish and parse typed messages, and deliver one that
must arrive (acknowledged by its subscriber, tried again where it was not)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TypeVar

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)
log = logging.getLogger(__name__)
REPEAT_S = 30.0  # an error said again within this is not logged again


@dataclass
class Repeats:
    """Which messages to say: each distinct one at most once every `every_s` (a server that
    is down fails every reconnect attempt, a few times a second, the same way)."""

    every_s: float = REPEAT_S
    said: dict[str, float] = field(default_factory=dict)  # message -> when it was last said

    def fresh(self, message: str, now: float) -> bool:
        """Whether to say `message` at `now` (if so, it counts as said then)."""
        if now - self.said.get(message, -self.every_s) < self.every_s:
            return False
        self.said = {m: t for m, t in self.said.items() if now - t < self.every_s}
        self.said[message] = now
        return True


async def connect(url: str, name: str) -> Client:
    """A connection to NATS that reconnects for ever (every 0.5 s); errors are logged in one
    line each, an error repeated within REPEAT_S once."""
    nc, repeats = Client(), Repeats()

    async def on_error(e: Exception) -> None:
        said = f"{type(e).__name__}: {e}"
        if repeats.fresh(said, time.monotonic()):
            log.warning("nats (%s): %s", name, said)

    async def on_disconnect() -> None:
        if not nc.is_closed:  # a close calls it too
            log.warning("nats (%s): disconnected; reconnecting", name)

    async def on_reconnect() -> None:
        log.info("nats (%s): reconnected", name)

    await nc.connect(url, name=name, max_reconnect_attempts=-1,
                     reconnect_time_wait=0.5,  # type: ignore[arg-type]  # typed int: seconds
                     error_cb=on_error, disconnected_cb=on_disconnect,
                     reconnected_cb=on_reconnect)
    return nc


async def publish(nc: Client, subject: str, message: BaseModel,
                  headers: dict[str, str] | None = None) -> None:
    await nc.publish(subject, message.model_dump_json().encode(), headers=headers)


async def deliver(nc: Client, subject: str, message: BaseModel,
                  headers: dict[str, str] | None = None, tries: int = 3,
                  try_s: float = 2.0) -> str | None:
    """Send `message` to a subscriber that acknowledges it (`acknowledge`), trying `tries`
    times, waiting `try_s` for the answer each: NATS delivers at most once, and a message
    published as the connection drops is lost without a word (a fault trial: requests sent
    as nats-server was killed waited for ever). None once acknowledged, else why not. The
    subscriber may get it twice (its answer lost): it takes the second for the first."""
    data, why = message.model_dump_json().encode(), ""
    for _ in range(tries):
        try:
            await nc.request(subject, data, timeout=try_s, headers=headers)
            return None
        except nats.errors.NoRespondersError:  # nobody subscribes now: restarting, perhaps
            why = "no subscriber"
            await asyncio.sleep(min(try_s, 0.5))
        except (nats.errors.Error, OSError) as e:  # no answer in time, or no connection
            why = str(e) or type(e).__name__
    return why


async def acknowledge(msg: Msg) -> None:
    """Tell the sender of `msg` it arrived, where it asked (`deliver`)."""
    if msg.reply:
        with contextlib.suppress(nats.errors.Error, OSError):
            await msg.respond(b"")


def parse(msg: Msg, model: type[M]) -> M:
    return model.model_validate_json(msg.data)
