"""NATS helpers: publish and parse typed messages."""

from __future__ import annotations

from typing import TypeVar

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)


async def connect(url: str, name: str) -> Client:
    return await nats.connect(url, name=name, max_reconnect_attempts=-1,
                              reconnect_time_wait=0.5)


async def publish(nc: Client, subject: str, message: BaseModel,
                  headers: dict[str, str] | None = None) -> None:
    await nc.publish(subject, message.model_dump_json().encode(), headers=headers)


def parse(msg: Msg, model: type[M]) -> M:
    return model.model_validate_json(msg.data)
