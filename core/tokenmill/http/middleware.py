"""Falcon middleware that runs before every route: the request's id and record, and the API key."""

from __future__ import annotations

import hmac
import re
import time
import uuid
from collections.abc import Callable

import falcon.asgi

from tokenmill.http.body import ApiError
from tokenmill.http.context import request_scope
from tokenmill.observability.logs import request_id_var
from tokenmill.observability.telemetry import RequestRecord, Telemetry

GENERATION_ROUTES = {
    "/generate": "generate",
    "/generate_stream": "generate_stream",
    "/": "compat_generate",
    "/v1/chat/completions": "chat_completions",
    "/v1/completions": "completions",
    "/invocations": "invocations",
}
"""Paths whose POSTs are generation requests: counted, timed, logged and traced."""

OPEN_ROUTES = frozenset({"/health", "/info", "/metrics", "/v1/models", "/ping", "/version",
                         "/api-doc/openapi.json", "/openapi.json", "/docs"})
"""What probes and scrapers read, and the API's own description: never behind ``--api-key`` (nor is
``GET /``, TGI's health check)."""


def is_open(req: falcon.asgi.Request) -> bool:
    """A probe's or scraper's request, or a CORS preflight (browsers send those without credentials)."""
    if req.path in OPEN_ROUTES or (req.path == "/" and req.method in ("GET", "HEAD")):
        return True
    return req.method == "OPTIONS" and bool(req.get_header("Access-Control-Request-Method"))

_CLIENT_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")


class RequestContext:
    """Give each request an id (the client's ``X-Request-Id`` when it is sane, else a new one),
    echoed in the response and attached to every log line written while it is handled, and a
    :class:`RequestRecord` for the generation routes (counted as they arrive). While the server
    drains, new generation requests get 503 and every response closes its connection."""

    def __init__(self, telemetry: Telemetry, draining: Callable[[], bool]) -> None:
        self.telemetry = telemetry
        self.draining = draining

    async def process_request(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        given = req.get_header("X-Request-Id")
        request_id = given if given and _CLIENT_ID.fullmatch(given) else uuid.uuid4().hex
        req.context.request_id = request_id
        request_id_var.set(request_id)
        resp.set_header("X-Request-Id", request_id)
        route = GENERATION_ROUTES.get(req.path) if req.method == "POST" else None
        if route is None:
            return
        record = request_scope(req).record = RequestRecord(request_id, route, time.time_ns())
        record.traceparent, record.tracestate = req.get_header("traceparent"), req.get_header("tracestate")
        self.telemetry.request_arrived(record)
        if self.draining():
            raise ApiError(503, "the server is shutting down", "unhealthy")

    async def process_response(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, resource: object,
                               req_succeeded: bool) -> None:
        if self.draining():  # so that load balancers stop reusing connections to this server
            resp.set_header("Connection", "close")


class ApiKeyAuth:
    """``--api-key``: every route but the open ones wants ``Authorization: Bearer <key>``, compared
    in constant time. CORS preflights pass (browsers send them without credentials)."""

    def __init__(self, api_key: str) -> None:
        self.expected = f"Bearer {api_key}".encode()

    async def process_request(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        if is_open(req):
            return
        given = (req.get_header("Authorization") or "").encode()
        if not hmac.compare_digest(given, self.expected):
            resp.set_header("WWW-Authenticate", "Bearer")
            raise ApiError(401, "Unauthorized: send the API key as `Authorization: Bearer <key>`", "authentication")


class Cors(falcon.CORSMiddleware):
    """Falcon's CORS, plus ``Vary: Origin`` where the answer depends on the origin, so that caches
    do not hand one origin's answer to another."""

    async def process_response_async(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, resource: object,
                                     req_succeeded: bool) -> None:
        self.process_response(req, resp, resource, req_succeeded)
        if self.allow_origins != "*":
            resp.append_header("Vary", "Origin")


def cors_middleware(allow_origin: str) -> Cors:
    """``--cors-allow-origin``: ``*`` or a comma-separated list of origins."""
    origins = [o.strip() for o in allow_origin.split(",") if o.strip()]
    return Cors(
        allow_origins="*" if "*" in origins else origins,
        expose_headers=["X-Request-Id", "X-Compute-Type", "X-Compute-Time", "X-Compute-Characters", "X-Total-Time",
                        "X-Validation-Time", "X-Queue-Time", "X-Inference-Time", "X-Time-Per-Token",
                        "X-Prompt-Tokens", "X-Generated-Tokens"])
