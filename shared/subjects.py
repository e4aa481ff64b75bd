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
