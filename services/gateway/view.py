"""The gateway's own view of the instances, kept from the heartbeats they publish on NATS:
dispatch and liveness checks read it locally, with no Redis round trip per request. Pure:
the caller passes the clock; heartbeats may be observed from another thread.

An instance is live while it is not silent next to its peers: its last heartbeat is at most
`ttl_s` older than the newest heartbeat the gateway has handled from anyone, and at most
`hard_ttl_s` old in any case (when every instance, or NATS itself, went quiet). Judging by
peers rather than by the clock alone keeps a gateway whose event loop was busy for a while
(a burst of clients) from taking its queued, not yet handled heartbeats for deaths.

A silence of everyone longer than half `ttl_s` (NATS restarting, or this gateway cut off;
instances beat every 0.5 s) ends with the first instance to reconnect, which the others
may follow by a second or more: each instance heard up to that silence is given `ttl_s`
from its end to be heard again before its peers judge it (likely how a 2.5 s nats-server
restart in a fault trial had the gateway take a prefill instance for dead and prefill
three requests again; 8 restarts under load since moved none as `prefill_died`, with or
without this)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from shared.state import InstanceInfo, Role


@dataclass(frozen=True)
class Seen:
    info: InstanceInfo
    at: float  # when the gateway handled the heartbeat (its monotonic clock)


def stuck_for(info: InstanceInfo) -> float:
    """How long the instance's engine had been at one step or call when it last beat (its
    own clock's seconds on both sides: no skew between hosts)."""
    return max(0.0, info.heartbeat_at - info.stuck_since) if info.stuck_since > 0 else 0.0


def stuck(info: InstanceInfo, after_s: float) -> bool:
    """Whether the instance's engine has been at one thing (a step, a KV export) for longer
    than `after_s` while it heartbeats on: an engine thread wedged with the GIL released (a
    kernel, a transfer that never returns) leaves its event loop and heartbeats going, so
    it looks live, and every request sent there would wait out the gateway's stall timeout
    before moving on; its supervisor kills it only after DS_STEP_TIMEOUT_S."""
    return stuck_for(info) > after_s


def unstuck(instances: list[InstanceInfo], after_s: float) -> list[InstanceInfo]:
    """Those of `instances` not `stuck` past `after_s`."""
    return [i for i in instances if not stuck(i, after_s)]


class InstanceView:
    def __init__(self, ttl_s: float, hard_ttl_s: float | None = None) -> None:
        self.ttl_s = ttl_s
        self.hard_ttl_s = hard_ttl_s if hard_ttl_s is not None else 5 * ttl_s
        self._seen: dict[str, Seen] = {}
        self._newest = float("-inf")
        # the last silence of everyone longer than half the TTL: when it began (the newest
        # heartbeat before it) and when it ended (the first one after); one tuple, read
        # whole from the other thread
        self._silence = (float("-inf"), float("-inf"))
        self._lock = threading.Lock()

    def observe(self, info: InstanceInfo, now: float) -> None:
        with self._lock:
            if self._newest > float("-inf") and now - self._newest > self.ttl_s / 2:
                self._silence = (self._newest, now)
            self._seen[info.instance_id] = Seen(info, now)
            self._newest = max(self._newest, now)

    def _live(self, seen: Seen, now: float) -> bool:
        if now - seen.at > self.hard_ttl_s:
            return False
        if self._newest - seen.at <= self.ttl_s:
            return True
        # silent next to its peers, but heard up to a silence of everyone that just ended
        began, ended = self._silence
        return seen.at >= began - self.ttl_s and now - ended <= self.ttl_s

    def get(self, instance_id: str, now: float) -> InstanceInfo | None:
        """The instance's last heartbeat, or None once it is no longer live."""
        seen = self._seen.get(instance_id)
        return seen.info if seen is not None and self._live(seen, now) else None

    def instances(self, role: Role, now: float) -> list[InstanceInfo]:
        with self._lock:
            seen = list(self._seen.values())
        live = [s.info for s in seen if s.info.role == role and self._live(s, now)]
        return sorted(live, key=lambda i: i.instance_id)

    def recent(self, role: Role, now: float) -> list[InstanceInfo]:
        """Instances of `role` heard from within the hard TTL, whatever their peers do."""
        with self._lock:
            seen = list(self._seen.values())
        return sorted((s.info for s in seen
                       if s.info.role == role and now - s.at <= self.hard_ttl_s),
                      key=lambda i: i.instance_id)

    def prune(self, now: float) -> None:
        """Forget instances silent for long enough that they are surely gone."""
        with self._lock:
            for instance_id in [i for i, s in self._seen.items()
                                if now - s.at > 2 * self.hard_ttl_s]:
                del self._seen[instance_id]
