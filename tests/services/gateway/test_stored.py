"""The responses the gateway keeps (services/gateway/stored.py), in a real valkey-server: a
conversation read back in order through its responses, each kept again as it is read; what
is not kept (deleted, or a response of the chain gone) is said to be missing."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.asyncio import Redis

from services.gateway import stored
from services.gateway.stored import Missing, ResponseStore
from shared import subjects


def said(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text}


def test_a_conversation_is_read_back_through_its_responses_in_order(redis_url: str) -> None:
    async def run() -> None:
        redis = Redis.from_url(redis_url)
        store = ResponseStore(redis, ttl_s=60)
        await store.put({"id": "resp_1", "n": 1}, [said("a"), said("A")], None)
        await store.put({"id": "resp_2", "n": 2}, [said("b"), said("B")], "resp_1")
        await store.put({"id": "resp_3", "n": 3}, [said("c")], "resp_2")
        await redis.expire(subjects.stored_response("resp_1"), 5)
        assert await store.get("resp_2") == {"id": "resp_2", "n": 2}
        assert [i["content"] for i in await store.conversation("resp_3")] == \
            ["a", "A", "b", "B", "c"]
        # read, each response of the conversation is kept ttl_s again
        assert await redis.ttl(subjects.stored_response("resp_1")) > 5
        assert [i["content"] for i in await store.conversation("resp_1")] == ["a", "A"]
        await store.delete("resp_2")
        with pytest.raises(Missing) as gone:
            await store.delete("resp_2")
        assert gone.value.args == ("resp_2",)
        with pytest.raises(Missing) as gone:  # the link missing, named
            await store.conversation("resp_3")
        assert gone.value.args == ("resp_2",)
        with pytest.raises(Missing):
            await store.get("resp_nothing")
        await redis.aclose()

    asyncio.run(run())


def test_a_conversation_longer_than_it_reads_back_is_refused(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stored, "MOST_TURNS", 3)

    async def run() -> None:
        redis = Redis.from_url(redis_url)
        store = ResponseStore(redis, ttl_s=60)
        for n in range(4):
            await store.put({"id": f"r{n}"}, [said(str(n))], f"r{n - 1}" if n else None)
        assert len(await store.conversation("r2")) == 3
        with pytest.raises(ValueError, match="more than 3 responses"):
            await store.conversation("r3")
        await redis.aclose()

    asyncio.run(run())
