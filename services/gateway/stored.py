"""Responses kept for `previous_response_id` and `GET`/`DELETE /v1/responses/{id}`, in Redis:
every gateway of the stack finds what another answered. A response is kept as two keys: the
response as it was answered (what `GET` shows), and its items (its input and its answer's
output items, logprobs left out) with the ids of the responses before it in its
conversation, so a conversation is read with two calls however long it is. Each response
kept keeps those before it `ttl_s` longer: a conversation lasts as long as it goes on.

A response belongs to the API key that asked for it (its `owner`, a digest of the key: the
key itself is never kept): read, gone on from or deleted with another key it is as missing
as one never kept, so one tenant cannot read another's conversations by their ids. A gateway
without keys keeps every response under one owner, the empty one."""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from shared import subjects

MOST_TURNS = 100  # responses one conversation goes through
LARGE = 1 << 16  # bytes of JSON read or written off the event loop


class Missing(LookupError):
    """A response is not kept (never stored, deleted, or its time ran out), or not for this
    owner: its id."""


def owner_of(api_key: str) -> str:
    """Whom the responses asked with `api_key` belong to: a digest of it ("" for no key)."""
    if not api_key:
        return ""
    return hashlib.sha256(b"distserve responses owner\0" + api_key.encode()).hexdigest()[:32]


class TooLong(ValueError):
    """A conversation goes through more than MOST_TURNS responses."""


@dataclass
class Conversation:
    items: list[dict[str, Any]] = field(default_factory=list)  # oldest first
    chain: list[str] = field(default_factory=list)  # the ids of its responses, oldest first


def history(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An answer's output items as a conversation keeps them: without their logprobs
    (a long answer's, each with its top ones, are megabytes nobody reads back)."""
    return [item | {"content": [{key: value for key, value in part.items()
                                 if key != "logprobs"} for part in item["content"]]}
            if item.get("type") == "message" else item for item in output]


async def loads(raw: bytes | str) -> Any:
    """JSON read; a large one off the event loop (a long answer's logprobs: a tenth of a
    second that every stream would wait)."""
    return await asyncio.to_thread(json.loads, raw) if len(raw) > LARGE else json.loads(raw)


async def owned(raw: bytes | str | None, response_id: str, owner: str) -> dict[str, Any]:
    """A response's conversation turn as kept (`raw`), where it is `owner`'s; else Missing
    (none kept, or another key's)."""
    record = None if raw is None else await loads(raw)
    if record is None or record.get("owner", "") != owner:
        raise Missing(response_id)
    return record  # type: ignore[no-any-return]


@dataclass
class ResponseStore:
    redis: Redis
    ttl_s: int  # how long a response is kept after it was answered or last gone on from

    async def put(self, response: dict[str, Any], input_items: list[dict[str, Any]],
                  earlier: Conversation | None = None, owner: str = "") -> None:
        """Keep `response`, asked `input_items` after the `earlier` conversation (which is
        kept as long again), as `owner`'s."""
        chain = earlier.chain if earlier is not None else []
        record = {"input": input_items, "output": history(response["output"]), "chain": chain,
                  "owner": owner}
        # written off the event loop: a long answer's logprobs are megabytes of JSON
        both = await asyncio.to_thread(lambda: (json.dumps(response), json.dumps(record)))
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(subjects.stored_response(response["id"]), both[0], ex=self.ttl_s)
            pipe.set(subjects.stored_items(response["id"]), both[1], ex=self.ttl_s)
            for before in chain:
                pipe.expire(subjects.stored_response(before), self.ttl_s)
                pipe.expire(subjects.stored_items(before), self.ttl_s)
            await pipe.execute()

    async def get(self, response_id: str, owner: str = "") -> dict[str, Any]:
        """The response as it was answered; Missing if it is not kept (for `owner`)."""
        raw, items = await self.redis.mget([subjects.stored_response(response_id),
                                            subjects.stored_items(response_id)])
        await owned(items, response_id, owner)
        if raw is None:
            raise Missing(response_id)
        return await loads(raw)  # type: ignore[no-any-return]

    async def _record(self, response_id: str, owner: str) -> dict[str, Any]:
        """What is kept of a response's conversation turn; Missing if not (for `owner`)."""
        return await owned(await self.redis.get(subjects.stored_items(response_id)),
                           response_id, owner)

    async def conversation(self, response_id: str, answered: bool = True, owner: str = ""
                           ) -> Conversation:
        """The conversation up to response `response_id`, its answer included (not where
        `answered` is False: the items it was answered from). Missing if one of its
        responses is not kept (for `owner`); TooLong past MOST_TURNS."""
        last = await self._record(response_id, owner)
        chain = [*last["chain"], response_id]
        if len(chain) > MOST_TURNS:
            raise TooLong(f"the conversation goes through more than {MOST_TURNS} responses: "
                          "send it as input instead")
        records = []
        if last["chain"]:
            raws = await self.redis.mget([subjects.stored_items(i) for i in last["chain"]])
            for before, each in zip(last["chain"], raws, strict=True):
                records.append(await owned(each, before, owner))
        items = [item for record in [*records, last]
                 for item in record["input"] + record["output"]]
        return Conversation(items if answered else items[:len(items) - len(last["output"])],
                            chain)

    async def delete(self, response_id: str, owner: str = "") -> None:
        """Missing if it is not kept (for `owner`)."""
        await self._record(response_id, owner)
        if not await self.redis.delete(subjects.stored_response(response_id),
                                       subjects.stored_items(response_id)):
            raise Missing(response_id)
