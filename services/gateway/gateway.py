"""The gateway's core: its view of the instances (from their NATS heartbeats), admission
(bounded in-flight requests), dispatch (to the prefill instance with the shortest queue and
the least-loaded decode instance, or to the least-loaded colocated worker; in auto mode to
whichever of the two routes is less loaded), and each request's token stream, moves and
follow-up."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import random
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from redis.asyncio import Redis
from redis.exceptions import RedisError

from services.gateway import tool_calls
from services.gateway.affinity import PrefixAffinity
from services.gateway.ledger import Booking, Ledger, Overloaded, Ticket
from services.gateway.metrics import Metrics
from services.gateway.openai_api import (
    APIError,
    ChatRequest,
    CompletionRequest,
    ContextExceeded,
)
from services.gateway.stored import ResponseStore
from services.gateway.stream import GaveUp, Lost, Relay
from services.gateway.timing import RequestTiming
from services.gateway.view import InstanceView, stuck, stuck_for, unstuck
from services.liveness import forget_alive, show_alive
from shared import subjects
from shared.aio import cancel_within
from shared.bus import connect, deliver, parse, publish
from shared.engine.block_manager import BlockHash
from shared.engine.config import served_name
from shared.engine.meta import read_meta
from shared.engine.structured import Guides
from shared.messages import Cancel, PrefillRequest, Resume, ResumeReply, Sampling, TokenChunk
from shared.state import (
    InstanceInfo,
    Registry,
    Role,
    leans,
    others_in_flight,
    pick_colocated,
    pick_decode,
    pick_prefill,
    redis_client,
)
from shared.telemetry import headers_for, setup_tracing
from shared.telemetry import shutdown as shutdown_tracing

log = logging.getLogger(__name__)
EXPIRY_MS = 5000  # the gateway's Redis keys (rewritten every 0.5 s) outlive it by this much


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DS_")

    nats_url: str = "nats://127.0.0.1:4222"
    redis_url: str = "redis://127.0.0.1:6379"
    alive_file: str = ""  # touched every second while the event loop runs (the supervisor's)
    model: str = "smollm2-135m"  # a built-in name, a .gguf, or a Hugging Face model directory
    served_model_name: str = ""  # what clients ask for (default: the directory's name)
    # what it dispatches to; auto: whatever is live (the online planner may switch modes)
    mode: Literal["auto", "disaggregated", "colocated"] = "auto"
    host: str = "127.0.0.1"
    port: int = 8000
    # a listening socket to serve on instead of binding host:port (the launcher's, bound
    # before the gateway starts and inherited by each incarnation)
    listen_fd: int | None = None
    # names its in-flight counts in Redis (default: random); the key's last field, so no ':'
    gateway_id: str = Field(default="", pattern=r"^[^:*?\[\]]*$")
    heartbeat_ttl_s: float = Field(default=2.0, gt=0)
    stall_timeout_s: float = Field(default=60.0, gt=0)  # no token nor engine step this long
    # an instance whose engine has been at one step or call this long gets no new request
    # (a wedged engine heartbeats on; a long prompt's step only sends the next ones on)
    stuck_after_s: float = Field(default=10.0, gt=0)
    max_moves: int = Field(default=3, ge=0)  # failovers of one request before it fails
    resume_timeout_s: float = Field(default=2.0, gt=0)  # a prefill instance asked for its KV
    # a request sent to a worker is acknowledged within this, or sent again (these times)
    dispatch_ack_s: float = Field(default=2.0, gt=0)
    dispatch_tries: int = Field(default=3, ge=1)
    failover_wait_s: float = Field(default=30.0, ge=0)  # for a live instance to move to
    # requests in flight at once; beyond it 429. 0: twice what the decoding instances batch
    max_inflight: int = Field(default=0, ge=0)
    retry_after_s: int = Field(default=1, ge=1)
    max_body_bytes: int = Field(default=1 << 20, gt=0)  # larger request bodies get 413
    api_keys: str = ""  # comma-separated; when set (or api_key_file), /v1/* need one
    api_key_file: str | None = None  # one key per line; '#' starts a comment
    protect_metrics: bool = False  # /metrics needs a key too
    # comma-separated origins whose web pages may call the API ("*": any); none: no CORS
    cors_origins: str = ""
    run_dir: str | None = None  # traces go here as JSON lines (unless OTLP is configured)
    # how long a /v1/responses answer is kept (in Redis) after it was last used, for a
    # previous_response_id and GET /v1/responses/{id}; 0: none is
    responses_ttl_s: int = Field(default=3600, ge=0)

    @property
    def served_model(self) -> str:
        return self.served_model_name or served_name(self.model)

    def origins(self) -> list[str]:
        return [o.strip() for o in self.cors_origins.split(",") if o.strip()]

    def keys(self) -> frozenset[str]:
        keys = [k.strip() for k in self.api_keys.split(",")]
        if self.api_key_file:
            lines = Path(self.api_key_file).read_text().splitlines()
            keys += [line.split("#", 1)[0].strip() for line in lines]
        return frozenset(k for k in keys if k)


def others(instances: list[InstanceInfo], avoid: str) -> list[InstanceInfo]:
    """`instances` but `avoid`, unless it is the only one."""
    return [i for i in instances if i.instance_id != avoid] or instances


class HeartbeatListener:
    """The instances' heartbeats, handled on a thread of its own with its own NATS connection
    and event loop: a gateway whose loop is busy with a burst of clients still sees them on
    time, and does not take the instances for dead."""

    def __init__(self, nats_url: str, name: str, view: InstanceView) -> None:
        self.nats_url, self.name, self.view = nats_url, name, view
        self._thread = threading.Thread(target=self._run, name="heartbeats", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        asyncio.run(self._listen())

    async def _listen(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        nc = await connect(self.nats_url, self.name)
        await nc.subscribe(subjects.HEARTBEATS, cb=self._on_heartbeat)
        await self._stop.wait()
        await nc.close()

    async def _on_heartbeat(self, msg: Msg) -> None:
        self.view.observe(parse(msg, InstanceInfo), time.monotonic())


@dataclass(frozen=True)
class Target:
    """Where a request goes: its worker (prefill or colocated), its decode instance ("" when
    colocated), and the most tokens (prompt + output) one request can have on both."""

    worker: str
    decode: str
    max_request_tokens: int


class Gateway:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.id = settings.gateway_id or f"gateway-{uuid.uuid4().hex[:6]}"
        # this incarnation's lease (subjects.gateway_key), named in each request it sends: a
        # gateway restarted under a fixed id is another one, which cancels nothing it sent
        self.lease = f"{self.id}.{uuid.uuid4().hex[:6]}" if settings.gateway_id else self.id
        config, self.tokenizer = read_meta(settings.model)
        self.guides = Guides(self.tokenizer, config.vocab_size)  # checks answers' formats
        # on threads of their own: a burst of heavy schemas delays no prompt's tokenizing
        self.checks = concurrent.futures.ThreadPoolExecutor(2, "grammar-check")
        self.served_model = settings.served_model  # once: it looks at the file system
        self.max_context = config.max_context
        self.metrics = Metrics()
        self.tracer = setup_tracing("gateway", settings.run_dir)
        self.view = InstanceView(settings.heartbeat_ttl_s)
        self.ledger = Ledger()
        self.affinity = PrefixAffinity()  # where each prompt's start went last
        self.decode_affinity = PrefixAffinity()  # and which decode instance it went on to
        self.elsewhere: dict[str, int] = {}  # other gateways' requests in flight, by instance
        # the live instances of each role left out of dispatch, their engine stuck
        self.stuck: dict[Role, set[str]] = {}
        self.listener = HeartbeatListener(settings.nats_url, f"{self.id}-heartbeats", self.view)
        self._tasks: set[asyncio.Task[None]] = set()
        self.nc: Client
        self.redis: Redis
        self.responses: ResponseStore | None = None  # the responses kept (None: none is)

    @property
    def roles(self) -> tuple[Role, ...]:
        mode = self.settings.mode
        if mode == "auto":
            return ("prefill", "decode", "colocated")
        return ("colocated",) if mode == "colocated" else ("prefill", "decode")

    async def start(self) -> None:
        self.nc = await connect(self.settings.nats_url, self.id)
        self.redis = redis_client(self.settings.redis_url)
        self.responses = ResponseStore(self.redis, self.settings.responses_ttl_s) \
            if self.settings.responses_ttl_s else None
        self.listener.start()
        await self._seed_view()
        self._spawn(self._publish_inflight())
        self._spawn(show_alive(self.settings.alive_file))

    async def stop(self) -> None:
        self.listener.stop()
        # none writes its keys again; one that ignores its cancel does not hold the stop
        await cancel_within(list(self._tasks), who=self.id)
        forget_alive(self.settings.alive_file)
        await self._delete_keys()
        self.checks.shutdown(wait=False, cancel_futures=True)
        shutdown_tracing()
        await self.nc.drain()
        await self.redis.aclose()

    async def _delete_keys(self) -> None:
        """This gateway's lease and in-flight counts, deleted as it stops: a worker then
        cancels what it may still hold of this gateway's, and a draining one does not wait
        for the counts to expire. Where Redis fails they expire by themselves."""
        try:
            counts = [k async for k in self.redis.scan_iter(
                match=subjects.inflight_keys(gateway=self.id), count=1000)]
            await self.redis.delete(subjects.gateway_key(self.lease), *counts)
        except (RedisError, OSError) as e:
            log.warning("cannot delete this gateway's keys in Redis (they expire in %d s): %s",
                        EXPIRY_MS // 1000, e)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- the instances -------------------------------------------------------------------

    async def _seed_view(self) -> None:
        """The instances already live when this gateway starts (their next heartbeats would
        tell it within one interval anyway)."""
        registry = Registry(self.redis, self.settings.heartbeat_ttl_s)
        now = time.monotonic()
        with contextlib.suppress(RedisError, OSError):
            for role in self.roles:
                for info in await registry.instances(role):
                    self.view.observe(info, now)

    def live(self, role: Role) -> list[InstanceInfo]:
        return self.view.instances(role, time.monotonic())

    def serving(self, role: Role) -> list[InstanceInfo]:
        """The live instances whose engine is not stuck (`stuck` in view.py: at one step or
        call past `stuck_after_s`); the others come back once it moves on. The streams
        already on a stuck decode instance move (stream.Relay), those on a stuck prefill
        instance or colocated worker only after the stall timeout: a prompt whose step is
        long would move from instance to instance."""
        live, after_s = self.live(role), self.settings.stuck_after_s
        was = self.stuck.get(role, set())
        # a draining worker's last word carries no time (heartbeat_at 0): it says nothing
        now = self.stuck[role] = {i.instance_id for i in live if stuck(i, after_s) or
                                  (i.heartbeat_at <= 0 and i.instance_id in was)}
        for info in live:
            if info.instance_id in now - was:
                log.info("%s: its engine has been at one step or call for %.0f s "
                         "(DS_STUCK_AFTER_S=%g); sending it nothing until it moves on",
                         info.instance_id, stuck_for(info), after_s)
            elif info.instance_id in was - now:
                log.info("%s: its engine moves on again; dispatching to it", info.instance_id)
        return [i for i in live if i.instance_id not in now]

    def live_pools(self) -> dict[Role, list[InstanceInfo]]:
        """The instances of each role this gateway dispatches to first (`serving`)."""
        return {role: self.serving(role) for role in self.roles}

    def is_stuck(self, instance_id: str) -> bool:
        info = self.view.get(instance_id, time.monotonic())
        return info is not None and stuck(info, self.settings.stuck_after_s)

    def resumable_from(self, prefill: str, cause: str) -> bool:
        """Whether a request moved for `cause` resumes from the KV `prefill` holds (rather
        than being prefilled again): yes unless that instance is stuck and either another
        prefill instance serves or a pull from it just failed (a CPU's exports run off the
        engine thread, a GPU's wait for it: a pull would time out there again and again)."""
        return not (self.is_stuck(prefill) and
                    (bool(self.serving("prefill")) or cause == "kv_transfer"))

    def stuck_pools(self) -> dict[Role, list[InstanceInfo]]:
        """The live instances of each role, those serving or, where the engine of every
        live one of a role is stuck, those: where no route is served otherwise (in auto
        mode a colocated worker serves beside a stuck prefill or decode instance), better a
        request that may have to move later than a 503 now."""
        return {role: self.serving(role) or self.live(role) for role in self.roles}

    def dispatchable(self, role: Role) -> list[InstanceInfo]:
        """The live instances; if none, those heard from lately (a starved host delays
        heartbeats: better a request that may have to move than a 503)."""
        now = time.monotonic()
        return self.view.instances(role, now) or self.view.recent(role, now)

    async def _publish_inflight(self, every_s: float = 0.5) -> None:
        """This gateway's lease and its in-flight counts per instance, in Redis with an
        expiry: a draining instance waits for the counts, a gateway that dies leaves none
        behind, and the workers cancel its requests once its lease is gone a while; and the
        other gateways' counts, which colocated and prefill dispatch count (`elsewhere`;
        none while Redis fails)."""
        failing = False
        while True:
            counts = self.ledger.per_instance()
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.set(subjects.gateway_key(self.lease), time.time(), px=EXPIRY_MS)
                    for instance, n in counts.items():
                        pipe.set(subjects.inflight_key(instance, self.id), n, px=EXPIRY_MS)
                    await pipe.execute()
                if {"colocated", "prefill"} & set(self.roles):  # what dispatch counts
                    self.elsewhere = await others_in_flight(self.redis, self.id)
                failing = False
            except (RedisError, OSError) as e:
                if not failing:
                    log.warning("cannot write in-flight counts to Redis: %s", e)
                failing, self.elsewhere = True, {}
            except Exception:  # the lease must outlive any one round's fault
                log.exception("writing this gateway's lease and counts failed; going on")
                self.elsewhere = {}
            self.ledger.forget_idle(counts)
            self.view.prune(time.monotonic())
            await asyncio.sleep(every_s)

    # -- admission and dispatch ------------------------------------------------------------

    def check_model(self, model: str) -> None:
        if model != self.served_model:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"`{self.served_model}`.", "model", "model_not_found")

    def inflight_limit(self) -> int:
        """DS_MAX_INFLIGHT, or twice what the decoding instances batch: those serving (a
        stuck one runs nothing of what is sent it), or where every one is stuck, those (its
        requests wait for them, as dispatch sends them there)."""
        if self.settings.max_inflight:
            return self.settings.max_inflight
        live = [i for role in self.roles if role != "prefill" for i in self.live(role)]
        serving = unstuck(live, self.settings.stuck_after_s)
        return max(16, 2 * sum(i.max_running for i in serving or live))

    def admit(self) -> Ticket:
        """A slot for one more request, or 429 with Retry-After before any work is done."""
        try:
            return self.ledger.admit(self.inflight_limit())
        except Overloaded as e:
            raise APIError(429, f"The server is at capacity ({e}); retry after "
                                f"{self.settings.retry_after_s}s.", kind="rate_limit_error",
                           code="rate_limit_exceeded",
                           headers={"Retry-After": str(self.settings.retry_after_s)}) from None

    def _roomy(self, decode: str, blocks: int) -> str:
        """`decode` where that instance has room for a request of `blocks` KV blocks and no
        pull waiting for room, else "": a decode instance is preferred where a prompt's
        start is cached only while that costs no wait (what it saves is a pull of that
        prefix's blocks)."""
        info = self.view.get(decode, time.monotonic()) if decode else None
        return decode if info is not None and info.queue_len == 0 and \
            info.free_blocks >= blocks else ""

    def _pick(self, role: Role, instances: list[InstanceInfo], prefer: str = "",
              saved: Mapping[str, int] | None = None) -> InstanceInfo | None:
        """The instance of `role` a request goes to, by what this gateway has in flight;
        `prefer` (where its prompt's start went last) where it is among the least loaded, or
        where it has no more prompt tokens to compute first, `saved` of them held by each
        instance (`leans`), with room for one more and no more requests of other gateways
        (a prefill instance: nor more in its heartbeat's queue than the gateways count)."""
        if role == "decode":
            return pick_decode(instances, self.ledger.decoding, prefer)
        if role == "colocated":  # its requests are counted as decoding from the start
            least = pick_colocated(instances, self.ledger.decoding, self.ledger.queued,
                                   self.elsewhere, prefer)
        else:
            least = pick_prefill(instances, self.ledger.prefilling, self.elsewhere, prefer)
        if least is None or least.instance_id == prefer or not saved:
            return least
        holder = next((i for i in instances if i.instance_id == prefer and not i.draining),
                      None)
        if holder is None:
            return least
        pending, elsewhere, there = self.ledger.pending, self.elsewhere, least.instance_id
        held = {i: self.ledger.decoding[i] + elsewhere.get(i, 0) for i in (prefer, there)}
        roomy = role == "prefill" or not holder.max_running or \
            held[prefer] < holder.max_running
        over = held[prefer] - held[there] if role == "colocated" else 0

        def unseen(i: InstanceInfo) -> int:  # queued there, not counted by the gateways
            sent = self.ledger.prefilling[i.instance_id] + elsewhere.get(i.instance_id, 0)
            return max(0, i.queue_len - sent) if role == "prefill" else 0
        lean = roomy and elsewhere.get(prefer, 0) <= elsewhere.get(there, 0) and \
            unseen(holder) <= unseen(least) and leans(
            (pending[there], saved.get(there, 0)), (pending[prefer], saved.get(prefer, 0)),
            over)
        return holder if lean else least

    def _load(self, instance: InstanceInfo) -> float:
        """How full the instance that decodes a route's requests is: what this gateway has
        in flight there and its queue, against the batch it runs."""
        held = self.ledger.decoding.get(instance.instance_id, 0) + instance.queue_len
        return held / max(1, instance.max_running)

    def routes(self, pools: dict[Role, list[InstanceInfo]], avoid: str = "",
               prefer: str = "", prefer_decode: str = "",
               saved: Mapping[str, int] | None = None) -> list[Target]:
        """Where a request can go, least-loaded first: a colocated worker, or a prefill
        instance and a decode instance (in "auto" mode both kinds: while the planner switches
        modes, or where both run side by side). `avoid` (an instance that failed) is in no
        route where there is another without it; `prefer` (the worker or prefill instance
        its prompt's start went to) and `prefer_decode` (the decode instance it went on to)
        are taken among those equally loaded, `prefer` also where the prompt's tokens it may
        hold make up for its queue (`saved`: each instance's; `_pick`)."""
        found: list[tuple[float, Target]] = []
        worker = self._pick("colocated", others(pools.get("colocated", []), avoid), prefer,
                            saved)
        if worker is not None:
            found.append((self._load(worker), self._target(worker, None)))
        prefill = self._pick("prefill", others(pools.get("prefill", []), avoid), prefer, saved)
        decode = self._pick("decode", others(pools.get("decode", []), avoid), prefer_decode)
        if prefill is not None and decode is not None:
            found.append((self._load(decode), self._target(prefill, decode)))
        ordered = [target for _, target in sorted(found, key=lambda f: f[0])]
        return [t for t in ordered if not avoid or avoid not in (t.worker, t.decode)] or ordered

    def _target(self, worker: InstanceInfo, decode: InstanceInfo | None) -> Target:
        limits = [i.max_request_tokens for i in (worker, decode)
                  if i is not None and i.max_request_tokens]
        return Target(worker.instance_id, decode.instance_id if decode else "",
                      min([self.max_context, *limits]))

    @property
    def wanted(self) -> str:
        """What serves a request, in words (for a 503)."""
        return {"disaggregated": "prefill/decode instance", "colocated": "colocated worker"
                }.get(self.settings.mode, "colocated worker nor prefill and decode instance")

    def dispatch(self, ticket: Ticket, hashes: Sequence[BlockHash] = (),
                 prompt_tokens: int = 0) -> Target:
        """The least-loaded route through live instances; if there is none, through those
        heard from lately (a starved host delays heartbeats: better a request that may have
        to move than a 503). Among the least loaded, or where what it may hold makes up for
        its queue (`_pick`), the instance an earlier prompt that starts as this one went to
        (`hashes`: its blocks', `PrefixAffinity.hashes`); among the least loaded, the decode
        instance it went on to, where those blocks may still be cached. Booked on the ticket
        at once, with the `prompt_tokens` its worker computes (those it may hold left out):
        the next request of a burst, dispatched before this one's stream opens, sees it."""
        holder, runs = self.affinity.found(hashes)
        saved = {i: n * self.affinity.block_size for i, n in runs.items()}
        decode = self._roomy(self.decode_affinity.holder(hashes), len(hashes) + 2)
        route = functools.partial(self.routes, prefer=holder, prefer_decode=decode,
                                  saved=saved)
        found = route(self.live_pools()) or route(self.stuck_pools()) or \
            route({role: self.serving(role) or self.dispatchable(role) for role in self.roles})
        if found and hashes:
            self.affinity.record(hashes, found[0].worker)
            if found[0].decode:
                self.decode_affinity.record(hashes, found[0].decode)
        if not found:
            raise APIError(503, f"no {self.wanted} is available; retry after "
                                f"{self.settings.retry_after_s}s", kind="server_error",
                           headers={"Retry-After": str(self.settings.retry_after_s)})
        computed = prompt_tokens - saved.get(found[0].worker, 0)
        ticket.booking = self.ledger.book(found[0].worker, found[0].decode, max(0, computed))
        return found[0]

    async def grammar(self, req: CompletionRequest | ChatRequest,
                      form: str | None = None) -> str:
        """The grammar the request's answer is held to ("" for none): its format's, or a
        call's in `form` (the model's call format) where tool_choice requires one; built and
        checked off the event loop (a schema's compile takes up to a few hundred ms): an
        answer can begin within it under the engines' limits, else a 400 naming the
        parameter."""
        forced = req.forced_functions if isinstance(req, ChatRequest) else None
        param = "tool_choice" if forced and form else req.format_param
        if param is None:
            return ""

        def checked() -> str:
            if forced and form and isinstance(req, ChatRequest):
                several = req.parallel_tool_calls and req.tool_choice == "required"
                grammar = tool_calls.forced_grammar(
                    forced, form, tool_calls.MOST_CALLS if several else 1)
            else:
                grammar = req.grammar()
            self.guides.check(grammar)
            return grammar
        try:
            return await asyncio.get_running_loop().run_in_executor(self.checks, checked)
        except (ValueError, RecursionError) as e:  # RecursionError: a schema nested too deep
            raise APIError(400, f"the answer cannot be held to this {param}: {e}",
                           param) from None

    def sampling(self, target: Target, prompt_len: int,
                 req: CompletionRequest | ChatRequest, grammar: str = "") -> Sampling:
        """The request's sampling, with max_tokens filled to what fits when omitted; a
        request that can never fit gets 400 naming the limit."""
        limit, max_tokens = target.max_request_tokens, req.token_limit
        room = limit - prompt_len
        if room < 1 or (max_tokens is not None and max_tokens > room):
            asked = f" plus max_tokens ({max_tokens})" if max_tokens is not None else ""
            raise ContextExceeded(f"This server's maximum context length is {limit} tokens "
                                  f"(prompt and completion, limited by the model's context "
                                  f"and the KV cache); the prompt ({prompt_len} tokens){asked} "
                                  "exceeds it.", "max_tokens" if room >= 1 else
                                  "messages" if isinstance(req, ChatRequest) else "prompt",
                                  limit - (max_tokens or 1))
        if any(token >= self.tokenizer.vocab_size for token, _ in req.bias_list):
            raise APIError(400, f"logit_bias names a token id past the vocabulary "
                                f"({self.tokenizer.vocab_size} tokens)", "logit_bias")
        return Sampling(max_tokens=max_tokens or room, temperature=req.temperature,
                        top_p=req.top_p, top_k=max(0, req.top_k),
                        seed=req.seed if req.seed is not None else random.getrandbits(62),
                        stop=req.stop_list, ignore_eos=req.ignore_eos,
                        logprobs=req.wants_logprobs, top_logprobs=req.top_count,
                        prompt_logprobs=req.scores_prompt,
                        presence_penalty=req.presence_penalty,
                        frequency_penalty=req.frequency_penalty, logit_bias=req.bias_list,
                        grammar=grammar, cache_salt=req.cache_salt or "")

    # -- one request ---------------------------------------------------------------------

    async def generate(self, request_id: str, target: Target, booked: Booking | None,
                       prompt_ids: list[int], sampling: Sampling, timing: RequestTiming
                       ) -> AsyncGenerator[TokenChunk, None]:
        """The request's token chunks until it finishes, moved to other instances (up to
        `max_moves` times) when the ones serving it fail; GaveUp if it cannot finish.
        `booked`: the target's count in the ledger (from dispatch), settled here."""
        # an attempt is held where it was sent once acknowledged there, within the retries
        absent_s = self.settings.dispatch_ack_s * self.settings.dispatch_tries + 2.0
        relay = Relay(self.nc, self.view, request_id, target.worker, target.decode,
                      self.settings.stall_timeout_s, absent_s=absent_s,
                      stuck_s=self.settings.stuck_after_s)
        await relay.open()
        span = self.tracer.start_span("request", attributes={
            "request_id": request_id, "prompt_tokens": len(prompt_ids),
            "max_tokens": sampling.max_tokens, "prefill": target.worker,
            "decode": target.decode})
        outcome = "cancelled"
        try:
            await self._prefill(relay, prompt_ids, sampling, timing, headers_for(span))
            while not relay.finished:
                try:
                    chunk = await relay.next()
                except Lost as lost:
                    if booked is not None:
                        booked.settle()
                        booked = None
                    await self._move(relay, lost, prompt_ids, sampling, timing)
                    span.add_event("moved", {"cause": lost.cause, "prefill": relay.worker,
                                             "decode": relay.decode})
                    booked = self._book(relay, len(prompt_ids) + len(relay.output_ids))
                    continue
                if relay.prefilled and booked is not None:
                    booked.prefilled()
                timing.tokens(len(chunk.token_ids))
                timing.cached_tokens = chunk.cached_tokens or timing.cached_tokens
                outcome = "refused" if chunk.refused else \
                    chunk.error or chunk.finish_reason or outcome
                yield chunk
        except GaveUp as e:
            outcome = str(e)
            raise
        finally:
            span.set_attribute("outcome", outcome)
            span.end()
            if booked is not None:
                booked.settle()
            # its own task: when the client went away this generator is being cancelled, and
            # every await here would be cancelled too, losing the cancel and the report
            self._spawn(self._after(relay, timing, outcome))

    def _book(self, relay: Relay, prompt_tokens: int = 0) -> Booking:
        """Count the relay's attempt in the ledger (dispatch spreads by these counts), its
        worker computing `prompt_tokens` again (the prompt and the tokens so far)."""
        booking = self.ledger.book(relay.worker, relay.decode, prompt_tokens)
        if relay.prefilled and relay.decode:  # its KV is held: only the decode side speaks
            booking.prefilled()  # (a colocated worker prefills it again: counted until then)
        return booking

    async def _prefill(self, relay: Relay, prompt_ids: list[int], sampling: Sampling,
                       timing: RequestTiming, headers: dict[str, str] | None = None) -> None:
        """Send the relay's attempt to its worker: the prompt, and the tokens relayed so
        far (a resumed request continues after them). One the worker never acknowledged
        (`deliver`: lost as NATS reconnected, or the worker gone) moves at the relay's next
        read."""
        why = await deliver(self.nc, subjects.prefill(relay.worker), PrefillRequest(
            request_id=relay.request_id, prompt_ids=prompt_ids, sampling=sampling,
            decode_instance=relay.decode, arrival_ts=timing.arrival_ts,
            output_ids=relay.output_ids, attempt=relay.attempt, gateway=self.lease),
            headers, self.settings.dispatch_tries, self.settings.dispatch_ack_s)
        if why is not None:
            relay.undelivered(f"{relay.worker} never acknowledged attempt {relay.attempt} of "
                              f"{relay.request_id} ({self.settings.dispatch_tries} tries: "
                              f"{why})")

    async def _move(self, relay: Relay, lost: Lost, prompt_ids: list[int],
                    sampling: Sampling, timing: RequestTiming) -> None:
        """Continue the request on live instances: from the KV its prefill instance still
        holds when it can (the new decode instance replays the tokens relayed since), else
        prefilled again with those tokens. The instances moved away from are told to drop
        it. GaveUp after `max_moves` moves, or when no instance is live to move to."""
        if relay.moves >= self.settings.max_moves:
            raise GaveUp(f"{lost} (moved {relay.moves} times already)")
        relay.moves += 1
        old_worker, old_decode, prefilled = relay.worker, relay.decode, relay.prefilled
        old_attempt = relay.attempt
        prefill_died = lost.cause == "prefill_died"
        failed = old_worker if prefill_died else relay.serving
        deadline = time.monotonic() + self.settings.failover_wait_s
        path = "re_prefill"
        if old_decode and prefilled and not prefill_died and \
                self.resumable_from(old_worker, lost.cause):  # its prefill instance holds the KV
            decode = await self._decode_to_resume(old_decode, deadline)
            if decode is not None:
                attempt = relay.new_attempt()
                if await self._resume(relay, old_worker, decode.instance_id, attempt):
                    relay.retarget(old_worker, decode.instance_id, prefilled=True,
                                   attempt=attempt)
                    path = "kv_held"
        if path == "re_prefill":  # a new attempt: a late "held" answer acts on the one asked
            route = await self._live_route(failed, deadline)
            relay.retarget(route.worker, route.decode, prefilled=not route.decode)
            if relay.output_ids:  # the prompt's scores went with the first token already
                sampling = sampling.model_copy(update={"prompt_logprobs": False})
            await self._prefill(relay, prompt_ids, sampling, timing)
        self.metrics.moves.labels(lost.cause, path).inc()
        log.info("moved %s after %d tokens (%s: %s) to %s%s, by %s", relay.request_id,
                 len(relay.output_ids), lost.cause, lost, relay.worker,
                 f" -> {relay.decode}" if relay.decode else "", path)
        for instance in {old_worker, old_decode} - {relay.worker, relay.decode, ""}:
            with contextlib.suppress(nats.errors.Error, OSError):
                await publish(self.nc, subjects.cancel(relay.request_id),
                              Cancel(request_id=relay.request_id, instance=instance,
                                     attempt=old_attempt))

    async def _resume(self, relay: Relay, prefill: str, decode: str, attempt: int) -> bool:
        """Ask `prefill` to announce the request's KV to `decode`, as `attempt`: whether it
        still held the KV."""
        if self.view.get(prefill, time.monotonic()) is None:
            return False
        try:
            reply = await self.nc.request(subjects.resume(prefill), Resume(
                request_id=relay.request_id, decode_instance=decode,
                output_ids=relay.output_ids, attempt=attempt).model_dump_json().encode(),
                timeout=self.settings.resume_timeout_s)
            return ResumeReply.model_validate_json(reply.data).held
        except (nats.errors.Error, OSError, ValueError) as e:
            log.info("%s cannot resume %s: %s", prefill, relay.request_id, e)
            return False

    def _live_routes(self, avoid: str) -> list[Target]:
        return self.routes(self.live_pools(), avoid) or self.routes(self.stuck_pools(), avoid)

    async def _decode_to_resume(self, avoid: str, deadline: float) -> InstanceInfo | None:
        """A live decode instance (another than `avoid` if there is one) to resume a request
        on from the KV its prefill instance holds (that instance may be draining); waits for
        one until `deadline` (a supervisor restarting it), or None: at once where another
        route serves (in auto mode, colocated workers)."""
        while True:
            decode = self._pick("decode", others(self.serving("decode"), avoid))
            if decode is None and not self.routes(self.live_pools(), avoid):
                decode = self._pick("decode", others(self.live("decode"), avoid))  # all stuck
            if decode is not None or self._live_routes(avoid) or time.monotonic() >= deadline:
                return decode
            await asyncio.sleep(0.25)

    async def _live_route(self, avoid: str, deadline: float) -> Target:
        """Live instances to move a request to, prefilled again, others than `avoid` where
        there are; waits for some until `deadline` (a supervisor restarting them), then
        GaveUp."""
        while True:
            found = self._live_routes(avoid)
            if found:
                return found[0]
            if time.monotonic() >= deadline:
                raise GaveUp(f"no live {self.wanted} to move the request to")
            await asyncio.sleep(0.25)

    async def _after(self, relay: Relay, timing: RequestTiming, outcome: str) -> None:
        """What follows a request: tell the workers to drop it unless one said it ended
        well, stop listening, and report it."""
        self.metrics.observe(timing, outcome)
        with contextlib.suppress(nats.errors.Error, OSError):
            if not relay.finished or relay.failed:  # a failure need not have stopped it
                await publish(self.nc, subjects.cancel(relay.request_id),
                              Cancel(request_id=relay.request_id))
            await relay.close()
            await publish(self.nc, subjects.REQUEST_EVENTS, timing.done(outcome))
