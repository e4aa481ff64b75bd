"""Instance registry in Redis (or Valkey): each instance heartbeats its load with an expiry,
so one that stops heartbeating drops out of dispatch by itself. Dispatch rules are pure."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Literal

from pydantic import BaseModel
from redis.asyncio import Redis

from shared import subjects

Role = Literal["prefill", "decode", "colocated"]


def redis_client(url: str, timeout_s: float = 2.0) -> Redis:
    """A Redis client whose every call gives up after `timeout_s`: a Redis that accepts
    connections and never answers must not hang a service."""
    return Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)


class StepSample(BaseModel):
    """One engine step as its worker timed it (the engine thread, handoff included): the
    prompt tokens it computed (whole prompts, or chunks of them), and the batch of decodes
    beside them and the tokens they attended to."""

    step: int  # the worker's step count when it ended (orders samples, drops repeats)
    prompts: list[int] = []  # tokens of each prompt computed
    batch: int = 0
    context: int = 0
    done: list[int] = []  # each prompt's tokens computed before the step; []: none (whole)
    seconds: float
    ended: float = 0.0  # wall clock (time.time()) when it ended; 0: not said


class InstanceInfo(BaseModel):
    version: Literal[1] = 1
    instance_id: str
    role: Role
    kv_address: str = ""  # UCX listener of a prefill instance, host:port
    queue_len: int = 0  # waiting requests
    preempted: int = 0  # decode: requests preempted, waiting to be recomputed
    running: int = 0  # requests in the running batch (decode) or parked (prefill)
    free_blocks: int = 0  # cached ones included (the pool takes them as it needs them)
    total_blocks: int = 0
    cached_blocks: int = 0  # free blocks holding a prefix a request may reuse
    draining: bool = False
    chunked: bool = False  # colocated: prefills in chunks, decodes riding along
    weights: str = "auto"  # the engine's weight format: auto (floats), int8, int4
    dtype: str = ""  # what it computes in ("float32", "bfloat16"); its KV pool is float32 on CPUs
    tp: int = 1  # tensor-parallel ranks (processes, devices) of each pipeline stage
    pp: int = 1  # pipeline stages of the instance
    machine: str = ""  # shared.host.machine_id(): instances of one machine share its cores
    busy_since: float = -1.0  # wall clock since which a step not yet counted has run (0: none)
    # wall clock since which the engine has been at one thing: that step, or a call on its
    # thread (a KV export or import, a request taken in); 0: none. Past the gateways'
    # DS_STUCK_AFTER_S they send it nothing (services/gateway/view.py `stuck`)
    stuck_since: float = 0.0
    # the step under way computes prompt tokens (on a decode instance: a recompute after
    # preemption, a failover's replay), so it may be long by rights: the gateways move the
    # streams of a stuck decode instance at once only where it does not
    stuck_on_prompts: bool = False
    max_request_tokens: int = 0  # prompt + output one request can have here (context, pool)
    max_running: int = 0  # requests the engine batches at most
    kv_requests: int = 0  # KV transfers served (prefill) or pulled (decode) over UCX
    kv_bytes: int = 0
    steps: int = 0  # engine steps so far
    stalled_steps: int = 0  # tries that ran nothing: the waiting requests do not fit the pool
    step_seconds: float = 0.0  # spent in them (the engine thread, handoff included)
    step_cpu_seconds: float = 0.0  # of which the engine thread was on a CPU
    step_queued_seconds: float = 0.0  # of which it was runnable, waiting for a CPU
    outputs_seconds: float = 0.0  # spent handling their outputs before the next step
    batched: int = 0  # requests that got a token, summed over steps
    # prefix caching: tokens of the requests admitted that looked for their prefix in the
    # KV pool, and those found there (not computed; a decode instance's: not pulled)
    prefix_queried: int = 0
    prefix_hits: int = 0
    recent_steps: list[StepSample] = []  # the last steps the latency model can price
    # request -> the attempt of it held here in any form (queued, taken in, pulled, running,
    # parked): a request a gateway waits on that its instance no longer holds has ended
    # there, or never arrived, with its chunks lost (NATS delivers at most once)
    held: dict[str, int] = {}
    heartbeat_at: float = 0.0


class Registry:
    def __init__(self, redis: Redis, ttl_s: float = 3.0) -> None:
        self.redis, self.ttl_s = redis, ttl_s

    async def heartbeat(self, info: InstanceInfo) -> None:
        info = info.model_copy(update={"heartbeat_at": time.time()})
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(subjects.instance_key(info.instance_id), info.model_dump_json(),
                     px=int(self.ttl_s * 1000))
            pipe.sadd(subjects.role_set(info.role), info.instance_id)
            await pipe.execute()

    async def remove(self, instance_id: str, role: Role) -> None:
        await self.redis.delete(subjects.instance_key(instance_id))
        await self.redis.srem(subjects.role_set(role), instance_id)

    async def instances(self, role: Role) -> list[InstanceInfo]:
        """Live instances of a role; expired ones are dropped from the role's set."""
        ids = sorted(m.decode() if isinstance(m, bytes) else m
                     for m in await self.redis.smembers(subjects.role_set(role)))
        if not ids:
            return []
        values = await self.redis.mget([subjects.instance_key(i) for i in ids])
        dead = [i for i, v in zip(ids, values, strict=True) if v is None]
        if dead:
            await self.redis.srem(subjects.role_set(role), *dead)
        return [InstanceInfo.model_validate_json(v) for v in values if v is not None]


def pick_prefill(instances: Sequence[InstanceInfo],
                 in_flight: Mapping[str, int] | None = None,
                 elsewhere: Mapping[str, int] | None = None,
                 prefer: str = "") -> InstanceInfo | None:
    """The paper's dispatch: the prefill instance with the shortest queue, counted as the
    requests sent there and not yet seen prefilled: the caller's own (`in_flight`) plus
    those other gateways publish (`elsewhere`, `others_in_flight`), fresher than a
    heartbeat, so a burst spreads out instead of piling onto one instance; or the
    heartbeat's queue where that is longer (it holds the caller's requests that arrived,
    so they are not counted twice, and the others' while their counts cannot be read).
    Ties go by the heartbeats' queue, then to `prefer` (where the prompt's start went: its
    KV may be cached there), then by batch and id."""
    mine, others = in_flight or {}, elsewhere or {}
    live = [i for i in instances if not i.draining]

    def key(i: InstanceInfo) -> tuple[int, int, bool, int, str]:
        sent = mine.get(i.instance_id, 0) + others.get(i.instance_id, 0)
        return max(sent, i.queue_len), i.queue_len, i.instance_id != prefer, i.running, \
            i.instance_id
    return min(live, key=key, default=None)


def pick_colocated(instances: Sequence[InstanceInfo], in_flight: Mapping[str, int],
                   queued: Mapping[str, int],
                   elsewhere: Mapping[str, int] | None = None,
                   prefer: str = "") -> InstanceInfo | None:
    """The colocated worker with the fewest requests, counted as the caller's own in flight
    there plus those other gateways have (`elsewhere`: their published in-flight counts,
    `others_in_flight`); on a tie, the fewest of the caller's still awaiting their first
    token (a new prompt waits behind those); then `prefer` (where the prompt's start went:
    its KV may be cached there); then by id. The planner's simulator dispatches by the same
    key, so that its requests go where the stack's do."""
    others = elsewhere or {}
    live = [i for i in instances if not i.draining]
    return min(live, key=lambda i: colocated_key(
        in_flight.get(i.instance_id, 0) + others.get(i.instance_id, 0),
        queued.get(i.instance_id, 0), i.instance_id, i.instance_id == prefer), default=None)


async def others_in_flight(redis: Redis, gateway: str) -> dict[str, int]:
    """{instance: requests in flight there} from every gateway but `gateway`, as they
    publish them (subjects.inflight_key: each rewritten every 0.5 s; a dead gateway's stays
    until it expires, 5 s). A gateway that cannot write to Redis is not counted."""
    # SCAN may return a key twice while Redis rehashes: once each
    keys = list(dict.fromkeys(
        [k async for k in redis.scan_iter(match=subjects.inflight_keys(), count=1000)]))
    counts: dict[str, int] = {}
    for key, value in zip(keys, await redis.mget(keys) if keys else [], strict=True):
        instance, owner = subjects.inflight_of(key.decode() if isinstance(key, bytes) else key)
        if owner != gateway and value is not None:
            counts[instance] = counts.get(instance, 0) + int(value)
    return counts


def colocated_key(held: int, queued: int, tiebreak: str | int, holds_prefix: bool = False
                  ) -> tuple[int, int, bool, str | int]:
    """The order colocated dispatch goes by, least first: requests held, then those of them
    awaiting their first token, then the one the prompt's start went to, then the name (the
    gateway's) or position (the simulator's)."""
    return held, queued, not holds_prefix, tiebreak


HELD_SLACK = 1  # requests a colocated worker may hold past the least loaded's and be leant to


def leans(least: tuple[int, int], holder: tuple[int, int], held_over: int = 0) -> bool:
    """Whether a prompt goes to the instance its start went to last (the holder) rather than
    to the least-loaded one, each given as (prompt tokens sent there and not yet past their
    first token, tokens of this prompt it may hold): where the holder has no more to compute
    before this prompt's first token, counted in prompt tokens (a prefill's time grows with
    them). So a conversation's next turn stays with its cache while the other instance has
    as much to compute first as that cache saves. A colocated worker also decodes what it
    holds: it is leant to holding at most HELD_SLACK requests more than the least loaded
    (`held_over`), so a turn that comes while its conversation's last answer still streams
    stays, and a burst of one prefix still spreads. A run counts from its dispatch on, before
    it is computed (prompts alike that one step admits each compute it: their pending
    tokens spread them). The gateway and the planner's simulator dispatch by it."""
    return held_over <= HELD_SLACK and holder[0] - holder[1] <= least[0] - least[1]


def pick_decode(instances: Sequence[InstanceInfo],
                in_flight: Mapping[str, int] | None = None, prefer: str = ""
                ) -> InstanceInfo | None:
    """The least-loaded decode instance: fewest requests the caller has sent there still
    running; then `prefer` (where the prompt's start was decoded last: its blocks may be
    cached there, and are not pulled again); then most free KV blocks, then the smallest
    batch."""
    mine = in_flight or {}
    live = [i for i in instances if not i.draining]
    return min(live, key=lambda i: (mine.get(i.instance_id, 0), i.instance_id != prefer,
                                    -i.free_blocks, i.running + i.queue_len, i.instance_id),
               default=None)
