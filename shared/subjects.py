"""Every NATS subject and Redis key the services use, named in one place."""

from __future__ import annotations

PREFIX = "ds"


def prefill(instance: str) -> str:
    """Requests for one prefill instance."""
    return f"{PREFIX}.prefill.{instance}"


def decode(instance: str) -> str:
    """KvReady announcements for one decode instance."""
    return f"{PREFIX}.decode.{instance}"


def release(instance: str) -> str:
    """A decode instance has pulled a request's KV: the prefill instance may free it."""
    return f"{PREFIX}.release.{instance}"


def resume(instance: str) -> str:
    """Requests (NATS request/reply) to re-announce a held KV to another decode instance."""
    return f"{PREFIX}.resume.{instance}"


def wanted(instance: str) -> str:
    """Requests (NATS request/reply) from prefill instances: is this parked KV still wanted?"""
    return f"{PREFIX}.wanted.{instance}"


def tokens(request_id: str) -> str:
    """The token stream of one request, back to the gateway."""
    return f"{PREFIX}.tokens.{request_id}"


def cancel(request_id: str) -> str:
    return f"{PREFIX}.cancel.{request_id}"


CANCEL_ALL = f"{PREFIX}.cancel.*"


# Redis keys
def instance_key(instance: str) -> str:
    return f"{PREFIX}:instance:{instance}"


def role_set(role: str) -> str:
    return f"{PREFIX}:instances:{role}"


def drain(instance: str) -> str:
    """Leave dispatch, finish what the instance holds, then exit."""
    return f"{PREFIX}.drain.{instance}"


REQUEST_EVENTS = f"{PREFIX}.events.requests"  # gateway -> profiler: one per finished request
REPLAN = f"{PREFIX}.planner.replan"  # profiler (or CLI) -> planner
# planner -> `distserve up`'s launcher (NATS requests): start a worker, which of those it
# started have exited, which run as first started, stop some (services.spawner)
LAUNCHER_START = f"{PREFIX}.launcher.start"
LAUNCHER_EXITED = f"{PREFIX}.launcher.exited"
LAUNCHER_STARTING = f"{PREFIX}.launcher.starting"
LAUNCHER_STOP = f"{PREFIX}.launcher.stop"


def inflight_key(instance: str, gateway: str) -> str:
    """Requests one gateway has sent to an instance and not yet seen leave it. The gateway
    rewrites it every 0.5 s with a 5 s expiry, so a dead gateway leaves no stale count."""
    return f"{PREFIX}:inflight:{instance}:{gateway}"


def inflight_keys(instance: str = "*", gateway: str = "*") -> str:
    """Pattern of every gateway's inflight_key for an instance (for every instance; of one
    gateway)."""
    return f"{PREFIX}:inflight:{instance}:{gateway}"


def inflight_of(key: str) -> tuple[str, str]:
    """(instance, gateway) of an inflight_key."""
    instance, gateway = key.removeprefix(f"{PREFIX}:inflight:").rsplit(":", 1)
    return instance, gateway


def gateway_key(gateway: str) -> str:
    """A gateway's lease: it rewrites the key every 0.5 s with a 5 s expiry and deletes it
    when it stops. A worker holding requests of a gateway whose key has been absent for
    DS_GATEWAY_LEASE_S cancels them (nobody is left to read their tokens)."""
    return f"{PREFIX}:gateway:{gateway}"


def lease_probe_key(reader: str) -> str:
    """What a worker writes as it reads the leases: a reading counts only where Redis takes
    writes (else no gateway could renew its lease)."""
    return f"{PREFIX}:lease-probe:{reader}"


HEARTBEATS = f"{PREFIX}.heartbeats"  # instances -> gateways: InstanceInfo, every heartbeat


PLAN_KEY = f"{PREFIX}:planner:plan"  # the plan in force, with its reason
PLAN_HISTORY_KEY = f"{PREFIX}:planner:history"
PROFILER_KEY = f"{PREFIX}:profiler:view"  # the profiler's current statistics
CALIBRATION_KEY = f"{PREFIX}:profiler:calibration"  # the latency model's scales, measured


def ready_key(service: str) -> str:
    """Set by a control service (profiler, planner) once it listens; removed when it stops."""
    return f"{PREFIX}:ready:{service}"


def stored_response(response_id: str) -> str:
    """A response of /v1/responses kept for the conversation it goes on (the gateway's
    ResponseStore), with an expiry."""
    return f"{PREFIX}:response:{response_id}"


def stored_items(response_id: str) -> str:
    """What a conversation keeps of that response: its input and answer as items, and the
    responses before it."""
    return f"{PREFIX}:response-items:{response_id}"
