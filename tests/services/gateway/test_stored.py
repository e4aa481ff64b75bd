"""The responses the gateway keeps (services/gateway/stored.py), in a real valkey-server: a
conversation read back in order through its responses, which each response kept keeps as
long again; what is not kept (deleted, or a response of the conversation gone) is said to
be missing, and a conversation too long to read back is refused."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.asyncio import Redis

from services.gateway import stored
from services.gateway.stored import Conversation, Missing, ResponseStore, TooLong
from shared import subjects


def said(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text}


def answer(response_id: str, text: str) -> dict[str, Any]:
    """A response whose answer is `text`, with its tokens' logprobs."""
    part = {"type": "output_text", "text": text, "annotations": [],
            "logprobs": [{"token": text, "logprob": -0.5}]}
    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
    return {"id": response_id, "output": [
        {"type": "message", "role": "assistant", "content": [part]}, call]}


def test_a_conversation_is_its_owners_to_the_first_response(redis_url: str) -> None:
    """Every response of a conversation is read as its owner's: one of its earlier
    responses kept as another's (not written so by the gateway, which goes on only from a
    response of the asker's) is missing from it, as one gone."""
    async def run() -> None:
        store = ResponseStore(Redis.from_url(redis_url), ttl_s=60)
        await store.put(answer("resp_1", "A"), [said("a")], owner="x")
        with pytest.raises(Missing):
            await store.conversation("resp_1", owner="y")
        with pytest.raises(Missing):
            await store.get("resp_1")  # no owner: not x's
        first = await store.conversation("resp_1", owner="x")
        await store.put(answer("resp_2", "B"), [said("b")], first, owner="y")
        with pytest.raises(Missing) as gone:
            await store.conversation("resp_2", owner="y")
        assert gone.value.args == ("resp_1",)
        with pytest.raises(Missing):
            await store.delete("resp_1", owner="y")
        await store.delete("resp_1", owner="x")
        await store.redis.aclose()

    asyncio.run(run())


def test_a_conversation_is_read_back_through_its_responses_in_order(redis_url: str) -> None:
    async def run() -> None:
        redis = Redis.from_url(redis_url)
        store = ResponseStore(redis, ttl_s=60)
        await store.put(answer("resp_1", "A"), [said("a")])
        first = await store.conversation("resp_1")
        assert first.chain == ["resp_1"]
        assert [i.get("content") for i in first.items] == [
            "a", [{"type": "output_text", "text": "A", "annotations": []}], None]
        await store.put(answer("resp_2", "B"), [said("b")], first)
        await redis.expire(subjects.stored_items("resp_1"), 5)
        second = await store.conversation("resp_2")
        assert second.chain == ["resp_1", "resp_2"]
        await store.put(answer("resp_3", "C"), [said("c")], second)
        # kept, a response keeps the conversation it goes on as long again
        assert await redis.ttl(subjects.stored_items("resp_1")) > 5
        third = await store.conversation("resp_3")
        assert [i["content"][0]["text"] if i["type"] == "message" and i.get("role") ==
                "assistant" else i.get("content", i["type"]) for i in third.items] == [
            "a", "A", "function_call", "b", "B", "function_call", "c", "C", "function_call"]
        # what it was answered from: the answer left out
        asked = await store.conversation("resp_3", answered=False)
        assert len(asked.items) == len(third.items) - 2 and asked.chain == third.chain
        # shown as answered: its logprobs too
        assert (await store.get("resp_2")) == answer("resp_2", "B")
        await store.delete("resp_2")
        with pytest.raises(Missing) as gone:
            await store.delete("resp_2")
        assert gone.value.args == ("resp_2",)
        with pytest.raises(Missing) as gone:  # the response missing on the way, named
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
        earlier = Conversation()
        for n in range(4):
            await store.put(answer(f"r{n}", str(n)), [said(str(n))], earlier)
            if n < 3:
                earlier = await store.conversation(f"r{n}")
        assert len(earlier.chain) == 3
        with pytest.raises(TooLong, match="more than 3 responses"):
            await store.conversation("r3")
        await redis.aclose()

    asyncio.run(run())
