"""The gateway's HTTP application: API keys and the body limit at the door, every error as
OpenAI-shaped JSON (unexpected ones too: 500 with an id, the traceback in the log), then the
routes."""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.gateway import Gateway, GatewaySettings
from services.gateway.openai_api import APIError, ParamError, error_body
from services.gateway.routes import add_routes
from services.gateway.stored import owner_of

__all__ = ["GatewaySettings", "create_app"]
log = logging.getLogger(__name__)


async def send_json(send: Send, status: int, body: dict[str, object],
                    headers: dict[str, str] | None = None) -> None:
    raw = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
        *((k.lower().encode(), v.encode()) for k, v in (headers or {}).items())]})
    await send({"type": "http.response.body", "body": raw})


class Door:
    """Pure ASGI (so streaming and disconnects pass untouched): API keys on /v1/* (and
    /metrics if asked), request bodies bounded (413), and an id on every request."""

    def __init__(self, app: ASGIApp, keys: frozenset[str], protect_metrics: bool,
                 max_body_bytes: int) -> None:
        self.app, self.keys, self.max_body_bytes = app, keys, max_body_bytes
        self.protect_metrics = protect_metrics

    def _guarded(self, path: str) -> bool:
        return bool(self.keys) and (path.startswith("/v1/") or
                                    (self.protect_metrics and path == "/metrics"))

    def _key(self, scope: Scope) -> str | None:
        """The API key the request shows, where it is one of the keys; else None."""
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, key = header.partition(" ")
        key = key.strip()
        known = [hmac.compare_digest(key.encode(), k.encode()) for k in self.keys]
        return key if scheme.lower() == "bearer" and any(known) else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["request_id"] = uuid.uuid4().hex
        key = self._key(scope) if self.keys else None
        state["owner"] = owner_of(key or "")  # whose responses it may read (stored.py)
        if self._guarded(scope["path"]) and key is None:
            await send_json(send, 401, error_body(
                "Missing or invalid API key: send 'Authorization: Bearer <key>'.",
                "invalid_request_error", code="invalid_api_key"),
                {"WWW-Authenticate": "Bearer"})
            return
        body = await self._read_body(receive)
        if body is None:
            await send_json(send, 413, error_body(
                f"The request body is larger than {self.max_body_bytes} bytes.",
                "invalid_request_error", code="request_too_large"))
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, or None once it passes the limit."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # the client went away; the app sees an empty body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return None
            if not message.get("more_body", False):
                break
        return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands out the body read already, then the client's later messages
    (a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


NOT_AN_OBJECT = "the request body must be a JSON object, sent with content-type: " \
    "application/json"
# what a body that is not a JSON object is told (FastAPI's error types at loc ("body",))
WHOLE_BODY = {
    "missing": "the request body is empty: send a JSON object (content-type: "
               "application/json)",
    "model_attributes_type": NOT_AN_OBJECT, "model_type": NOT_AN_OBJECT,
}


def _named(part: object) -> bool:
    """A field name or list index of the request, not a pydantic union branch's tag
    ("str", "function-after[...]")."""
    return isinstance(part, int) or (isinstance(part, str) and part.isidentifier()
                                     and part not in {"str", "int", "float", "bool", "list"})


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    settings = settings or GatewaySettings()
    gateway = Gateway(settings)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        yield
        await gateway.stop()

    # the gateway's own "request" span is the trace's root; FastAPI's per-request spans and
    # metrics would triple the tracing work of every request, a 429 included
    # redirect_slashes off: a path with a trailing slash gets the 404 naming the routes, in
    # JSON, not a 307 with an empty body that a POST may not follow
    app = FastAPI(title="distserve gateway", lifespan=lifespan, redirect_slashes=False,
                  telemetry={"tracing": False, "metrics": False, "logs": False,
                             "operation_spans": False})
    app.state.gateway = gateway
    add_error_handlers(app, gateway)
    add_routes(app, gateway)
    app.add_middleware(Door, keys=settings.keys(),
                       protect_metrics=settings.protect_metrics,
                       max_body_bytes=settings.max_body_bytes)
    if origins := settings.origins():  # outside the door: a preflight carries no key
        app.add_middleware(CORSMiddleware, allow_origins=origins,
                           allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["*"], max_age=600)
    return app


def add_error_handlers(app: FastAPI, gateway: Gateway) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        if not e.counted:
            gateway.metrics.rejected(e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0]
        loc = tuple(first.get("loc", ()))
        where = ".".join(str(p) for p in loc[1:] if _named(p)) or None
        # a validator's own message, without the "Value error, " pydantic puts before it
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        named = "" if where is None else f" ({where})"
        if isinstance(refused := first.get("ctx", {}).get("error"), ParamError):
            where, named = refused.param, ""  # a request-wide validator's: its message names it
        if first.get("type") == "json_invalid":  # its loc: ("body", character position)
            where, named, message = None, "", "the request body is not valid JSON"
            if isinstance(loc[-1], int):
                message += f" (at character {loc[-1]})"
        elif loc == ("body",):  # the body as a whole: empty, or not a JSON object
            message = WHOLE_BODY.get(first.get("type", ""), message)
        gateway.metrics.rejected(400)
        return JSONResponse(APIError(400, message + named, where).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        message = str(e.detail)
        no_route = e.status_code == 404 and message == "Not Found"
        if not (no_route or e.status_code == 405):  # a probe of another path or method is
            gateway.metrics.rejected(e.status_code)  # no request to the API
        if no_route:
            served = [f"{method} {route.path_format}" for route in request.app.routes
                      if isinstance(route, APIRoute) for method in sorted(route.methods or ())
                      if method != "HEAD"]  # each GET's HEAD goes without saying
            message = f"This server does not serve {request.url.path[:200]}; it serves " \
                      f"{', '.join(served)}."
        return JSONResponse(error_body(message, kind), status_code=e.status_code,
                            headers=e.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> JSONResponse:
        request_id = request.scope.get("state", {}).get("request_id", "")
        log.error("request %s failed unexpectedly", request_id, exc_info=e)
        gateway.metrics.rejected(500)
        return JSONResponse(error_body(f"Internal error (request id {request_id}); the "
                                       "server's log has the details.", "server_error"),
                            status_code=500)
