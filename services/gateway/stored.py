"""Responses kept for `previous_response_id` and `GET`/`DELETE /v1/responses/{id}`, in Redis:
every gateway of the stack finds what another answered. A response is kept with its own
items (what it was asked, what it answered) and the id of the one before it; a conversation
is read by walking back to its first response, and each of its responses is kept another
`ttl_s` from then, so a conversation lasts as long as it goes on."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from shared import subjects

MOST_TURNS = 1000  # responses one conversation is read back through


class Missing(LookupError):
    """A response is not kept (never stored, deleted, or its time ran out): its id."""


@dataclass
class ResponseStore:
    redis: Redis
    ttl_s: int  # how long a response is kept after it was last used

    async def put(self, response: dict[str, Any], items: list[dict[str, Any]],
                  previous: str | None) -> None:
        record = {"response": response, "items": items, "previous": previous}
        await self.redis.set(subjects.stored_response(response["id"]), json.dumps(record),
                             ex=self.ttl_s)

    async def get(self, response_id: str) -> dict[str, Any]:
        """The response as it was answered; Missing if it is not kept."""
        return (await self._record(response_id))["response"]  # type: ignore[no-any-return]

    async def conversation(self, response_id: str) -> list[dict[str, Any]]:
        """The items of the conversation up to response `response_id` (its answer
        included), oldest first; each of its responses kept `ttl_s` from now. Missing if one
        of them is not kept; ValueError past MOST_TURNS."""
        records: list[dict[str, Any]] = []
        at: str | None = response_id
        while at is not None:
            if len(records) == MOST_TURNS:
                raise ValueError(f"the conversation goes back more than {MOST_TURNS} "
                                 "responses: send it as input instead")
            records.append(record := await self._record(at))
            at = record["previous"]
        async with self.redis.pipeline(transaction=False) as pipe:
            for record in records:
                pipe.expire(subjects.stored_response(record["response"]["id"]), self.ttl_s)
            await pipe.execute()
        return [item for record in reversed(records) for item in record["items"]]

    async def delete(self, response_id: str) -> None:
        """Missing if it is not kept."""
        if not await self.redis.delete(subjects.stored_response(response_id)):
            raise Missing(response_id)

    async def _record(self, response_id: str) -> dict[str, Any]:
        raw = await self.redis.get(subjects.stored_response(response_id))
        if raw is None:
            raise Missing(response_id)
        return json.loads(raw)  # type: ignore[no-any-return]
