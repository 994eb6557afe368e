"""``--hold-while-loading N``: requests that arrive while the model loads wait for it instead of a 503.

An ASGI wrapper, outside the routes: a held request's body is read, then it waits until the server can
serve (or the load failed) and goes on to its route as if it had just arrived. A stream is answered at
once (200, ``text/event-stream``) with an SSE comment every :data:`HEARTBEAT_SECONDS`, so that proxies
and clients keep the connection; its route's answer then follows in the same response (a route's error
as one ``data:`` event with TGI's ``{"error", "error_type"}``). Up to N requests are held at once; the
others, and every request once the model has failed to load, reach their route at once, which answers
503. ``/health`` is not held: it says 503 until the model is ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

from tokenmill.config import Config
from tokenmill.http.middleware import ApiKeyAuth
from tokenmill.http.state import ServerState

HEARTBEAT_SECONDS = 2.0
"""How often a held stream gets an SSE comment."""

HELD_PATHS = frozenset({"/", "/generate", "/generate_stream", "/v1/chat/completions", "/v1/completions",
                        "/v1/responses", "/v1/messages", "/invocations", "/v1/embeddings", "/embed", "/rerank",
                        "/v1/rerank", "/score", "/classify"})
"""The routes that run the model (a request to any other is answered as it is, ready or not)."""

STREAM_FIELD_PATHS = frozenset({"/", "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                                "/invocations"})
"""Held routes whose body's ``stream`` field asks for a stream (``/generate_stream`` always streams)."""

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class LoadingHold:
    """ASGI wrapper holding up to ``--hold-while-loading`` requests to the model's routes until it loads."""

    def __init__(self, app: Callable[..., Awaitable[None]], state: ServerState) -> None:
        self.app = app
        self.state = state
        self.held = 0
        keys = state.config.api_keys
        self.auth = ApiKeyAuth(keys) if keys else None

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if not self._holds(scope):
            await self.app(scope, receive, send)
            return
        self.held += 1
        try:
            read = await read_body(receive, self.state.config)
            if read.ended or not read.whole or len(read.body) > self.state.config.payload_limit:
                # left, or a body too large or too slow: not held, its route answers at once
                if not read.ended:
                    await self.app(scope, replay(read.messages, receive), send)
                return
            if loaded(self.state):  # meanwhile
                await self.app(scope, replay(read.messages, receive), send)
                return
            path = scope["path"]
            stream = path == "/generate_stream" or (path in STREAM_FIELD_PATHS and wants_stream(read.body))
            left = asyncio.ensure_future(receive())  # an http.disconnect while it waits
            try:
                if stream:
                    await start_stream(send)
                if not await self._ready_or_left(left, send if stream else None):
                    return
            except BaseException:
                left.cancel()
                raise
        finally:
            self.held -= 1
        await self.app(scope, replay([*read.messages, left], receive), streamed_answer(send) if stream else send)

    def _holds(self, scope: dict[str, Any]) -> bool:
        state = self.state
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in HELD_PATHS:
            return False
        if loaded(state) or state.draining:
            return False
        if self.held >= state.config.hold_while_loading:
            return False
        if self.auth is not None:  # a request without a key gets its 401 at once, and holds no place
            headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
            return self.auth.match(headers.get("authorization"), headers.get("x-api-key")) is not None
        return True

    async def _ready_or_left(self, left: asyncio.Future[dict[str, Any]], stream: Send | None) -> bool:
        """Wait until the server can serve or its load failed (True), or the client left (False); a
        stream gets a heartbeat meanwhile."""
        state = self.state
        beat = asyncio.get_running_loop().time() + HEARTBEAT_SECONDS
        while not loaded(state):
            if left.done() and left.result()["type"] == "http.disconnect":
                return False
            await asyncio.sleep(0.05)
            if stream is not None and asyncio.get_running_loop().time() >= beat:
                beat += HEARTBEAT_SECONDS
                await stream({"type": "http.response.body", "body": b": loading the model\n\n", "more_body": True})
        return True


def loaded(state: ServerState) -> bool:
    """The model's load is over: it serves, or it failed."""
    return state.serving is not None or state.load_error is not None


async def read_body(receive: Receive, config: Config) -> ReadBody:
    """A request's body as far as ``--payload-limit`` and ``--body-read-timeout`` allow."""
    read = ReadBody()

    async def fill() -> None:
        while not read.whole and not read.ended and len(read.body) <= config.payload_limit:
            read.take(await receive())

    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(fill(), config.body_read_timeout)
    return read


class ReadBody:
    """What a held request's channel gave while its body was read."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.body = b""
        self.whole = False
        """The last part of the body came."""
        self.ended = False
        """The client left before it did."""

    def take(self, message: dict[str, Any]) -> None:
        self.messages.append(message)
        if message["type"] != "http.request":
            self.ended = True
            return
        self.body += message.get("body", b"")
        self.whole = not message.get("more_body")


def body_object(body: bytes) -> dict[str, Any]:
    """A JSON body's object (empty for a body that is no JSON object: its route answers that)."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def wants_stream(body: bytes) -> bool:
    """Whether a JSON body asks for a stream (``"stream": true``)."""
    return body_object(body).get("stream") is True


def replay(messages: list[Any], receive: Receive) -> Receive:
    """The request's channel for its route: the ``messages`` taken off it while it was held (a future: the
    message it waited for meanwhile), then the channel itself."""
    pending = list(messages)

    async def replayed() -> dict[str, Any]:
        if pending:
            first = pending.pop(0)
            return await first if isinstance(first, asyncio.Future) else first
        return await receive()

    return replayed


async def start_stream(send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [
        (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})


def streamed_answer(send: Send) -> Send:
    """``send`` for a held stream whose response already started: the route's own start is dropped; its
    body follows when it answered 200, and an error answer becomes one SSE ``data:`` event."""
    status = 200
    error = bytearray()

    async def forward(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
            return
        if message["type"] != "http.response.body" or status == 200:
            await send(message)
            return
        error.extend(message.get("body", b""))
        if not message.get("more_body"):
            await send({"type": "http.response.body", "body": b"data: " + error_event(bytes(error), status) + b"\n\n",
                        "more_body": False})

    return forward


def error_event(body: bytes, status: int) -> bytes:
    """A route's error answer as a stream's error event: its ``{"error", "error_type"}`` on one line."""
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict) or "error" not in parsed:
        parsed = {"error": body.decode("utf-8", errors="replace") or f"status {status}", "error_type": "unhealthy"}
    return json.dumps(parsed, separators=(",", ":")).encode()
