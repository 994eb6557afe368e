"""Falcon middleware that runs before every route: the request's id and record, and the API key."""

from __future__ import annotations

import hashlib
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
    "/v1/messages": "messages",
    "/v1/responses": "responses",
    "/v1/embeddings": "embeddings",
    "/embed": "embed",
    "/v1/rerank": "rerank",
    "/rerank": "rerank",
    "/score": "score",
    "/classify": "classify",
}
"""Paths whose POSTs are inference requests (generation, embeddings, scores): counted, timed, logged and traced."""

OPEN_ROUTES = frozenset({"/health", "/info", "/metrics", "/v1/models", "/ping", "/version",
                         "/api-doc/openapi.json", "/openapi.json", "/docs"})
"""What probes and scrapers read, and the API's own description: never behind ``--api-key`` (nor is
``GET /``, TGI's health check)."""


def is_open(req: falcon.asgi.Request) -> bool:
    """A probe's or scraper's request, or a CORS preflight (browsers send those without credentials)."""
    return open_route(req.path, req.method, bool(req.get_header("Access-Control-Request-Method")))


def open_route(path: str, method: str, preflight: bool) -> bool:
    """:func:`is_open` for a path and method; ``preflight``: the request has ``Access-Control-Request-Method``."""
    if path in OPEN_ROUTES or (path == "/" and method in ("GET", "HEAD")):
        return True
    return method == "OPTIONS" and preflight

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


UNAUTHORIZED = "Unauthorized: send the API key as `Authorization: Bearer <key>`"


class ApiKeyAuth:
    """``--api-key`` / ``--api-key-file``: every route but the open ones wants ``Authorization: Bearer
    <key>`` (or Anthropic's ``x-api-key: <key>``) with one of the keys, compared in constant time
    (UTF-8, as clients send non-ASCII keys).
    The key names the request's tenant (:attr:`RequestScope.tenant`). CORS preflights pass (browsers
    send them without credentials)."""

    def __init__(self, keys: tuple[str, ...], priority_keys: tuple[str, ...] | None = None) -> None:
        self.expected = [(f"Bearer {key}".encode(), tenant_of(key), priority_keys is None or key in priority_keys)
                         for key in keys]

    async def process_request(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        if is_open(req):
            return
        # ASGI servers hand headers over as latin-1 text: its bytes are what the client sent.
        matched = self.match(req.get_header("Authorization"), req.get_header("x-api-key"))
        if matched is None:
            resp.set_header("WWW-Authenticate", "Bearer")
            raise ApiError(401, UNAUTHORIZED, "authentication")
        scope = request_scope(req)
        scope.tenant, scope.may_set_priority = matched

    def match(self, authorization: str | None, anthropic_key: str | None) -> tuple[str, bool] | None:
        """The tenant and whether it may set priorities, for the key the headers present; None for no key's."""
        header = authorization or (f"Bearer {anthropic_key}" if anthropic_key else "")
        given = header.encode("latin-1", errors="replace")
        matched = None
        for expected, tenant, may_set_priority in self.expected:  # every key compared, whichever matches
            if hmac.compare_digest(given, expected):
                matched = tenant, may_set_priority
        return matched


def tenant_of(key: str) -> str:
    """A tenant's id: a digest of its key, so that nothing downstream holds the key itself."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


class Cors(falcon.CORSMiddleware):
    """Falcon's CORS, plus ``Vary: Origin`` where the answer depends on the origin, so that caches
    do not hand one origin's answer to another."""

    async def process_response_async(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, resource: object,
                                     req_succeeded: bool) -> None:
        self.process_response(req, resp, resource, req_succeeded)
        if self.allow_origins != "*":
            resp.append_header("Vary", "Origin")


def cors_middleware(origins: tuple[str, ...]) -> Cors:
    """``--cors-allow-origin``: ``*`` or the origins listed."""
    return Cors(
        allow_origins="*" if "*" in origins else list(origins),
        expose_headers=["X-Request-Id", "X-Compute-Type", "X-Compute-Time", "X-Compute-Characters", "X-Total-Time",
                        "X-Validation-Time", "X-Queue-Time", "X-Inference-Time", "X-Time-Per-Token",
                        "X-Prompt-Tokens", "X-Generated-Tokens"])
