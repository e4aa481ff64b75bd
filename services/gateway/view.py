"""The gateway's own view of the instances, kept from the heartbeats they publish on NATS:
dispatch and liveness checks read it locally, with no Redis round trip per request. Pure:
the caller passes the clock; heartbeats may be observed from another thread.

An instance is live while it is not silent next to its peers: its last heartbeat is at most
`ttl_s` older than the newest heartbeat the gateway has handled from anyone, and at most
`hard_ttl_s` old in any case (when every instance, or NATS itself, went quiet). Judging by
peers rather than by the clock alone keeps a gateway whose event loop was busy for a while
(a burst of clients) from taking its queued, not yet handled heartbeats for deaths."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from shared.state import InstanceInfo, Role


@dataclass(frozen=True)
class Seen:
    info: InstanceInfo
    at: float  # when the gateway handled the heartbeat (its monotonic clock)


class InstanceView:
    def __init__(self, ttl_s: float, hard_ttl_s: float | None = None) -> None:
        self.ttl_s = ttl_s
        self.hard_ttl_s = hard_ttl_s if hard_ttl_s is not None else 5 * ttl_s
        self._seen: dict[str, Seen] = {}
        self._newest = float("-inf")
        self._lock = threading.Lock()

    def observe(self, info: InstanceInfo, now: float) -> None:
        with self._lock:
            self._seen[info.instance_id] = Seen(info, now)
            self._newest = max(self._newest, now)

    def _live(self, seen: Seen, now: float) -> bool:
        return self._newest - seen.at <= self.ttl_s and now - seen.at <= self.hard_ttl_s

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
