"""Which gateways are gone, for a worker holding their requests.

A gateway heartbeats its lease key in Redis (subjects.gateway_key: every 0.5 s, a 5 s
expiry) and deletes it when it stops. One killed never cancels what it sent (its clients'
connections died with it, and a restarted gateway is another incarnation under another
name), so the workers would run those requests to max_tokens with nobody listening, their
KV held. A worker reads the keys of the gateways whose requests it holds and cancels the
requests of each gateway gone."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from redis.asyncio import Redis
from redis.exceptions import RedisError

from shared import subjects

PROBE_MS = 5000  # the expiry of a reader's probe key


class GatewayLeases:
    """Gateways whose lease key every reading for `lease_s` found absent. A reading that
    failed (None: Redis down, slow, restarting) says nothing, and like one that found the
    key starts the count again: a Redis blip, or a Valkey restart that loses every key until
    each gateway writes its own again (within 0.5 s), takes no gateway for gone. Pure: the
    caller reads the keys and gives the time."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._absent_since: dict[str, float] = {}  # gateway -> first of its absent readings

    def observe(self, present: Mapping[str, bool | None], now: float) -> dict[str, float]:
        """One round of readings, for each gateway whose requests are held now (the others
        are forgotten): whether its key was there. The gateways gone, each with the seconds
        its key has been read absent; one still held next round is gone again."""
        self._absent_since = {gateway: since for gateway, since in self._absent_since.items()
                              if present.get(gateway) is False}
        gone = {}
        for gateway in [g for g, there in present.items() if there is False]:
            absent_s = now - self._absent_since.setdefault(gateway, now)
            if absent_s >= self.lease_s:
                gone[gateway] = absent_s
        return gone


async def read_leases(redis: Redis, gateways: Collection[str],
                      reader: str = "") -> dict[str, bool | None]:
    """Whether each gateway's lease key is in Redis (one round trip); None for every one
    where Redis did not answer, or would not take a write: a Redis that refuses writes but
    serves reads (out of memory, a failed save, too few replicas, a read-only replica) lets
    every lease lapse while the gateways live. `reader` names the probe key written so."""
    names = sorted(gateways)
    if not names:
        return {}
    try:
        async with redis.pipeline(transaction=False) as pipe:
            pipe.set(subjects.lease_probe_key(reader), 1, px=PROBE_MS)
            pipe.mget([subjects.gateway_key(g) for g in names])
            _, values = await pipe.execute()
    except (RedisError, OSError):
        return dict.fromkeys(names)
    return {gateway: value is not None for gateway, value in zip(names, values, strict=True)}
