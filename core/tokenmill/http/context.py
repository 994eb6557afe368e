"""One ASGI request's own state, as a typed object in its scope, and the watch on its connection:
the moment ``http.disconnect`` arrives, the callbacks registered for it run (cancelling its
sequences)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import falcon.asgi

from tokenmill.observability.telemetry import RequestRecord

if TYPE_CHECKING:
    from tokenmill.http.state import ServerState

SCOPE_KEY = "tokenmill"
"""The one entry tokenmill keeps in an ASGI scope: the request's :class:`RequestScope`."""


@dataclass
class RequestScope:
    """What tokenmill keeps for one HTTP request while it is handled."""

    state: ServerState
    receive: Callable[[], Awaitable[Any]]
    """The ASGI receive channel, watched for ``http.disconnect``."""
    on_disconnect: list[Callable[[], None]] = field(default_factory=list)
    """Called once, the moment the client disconnects."""
    record: RequestRecord | None = None
    """The record of a generation request (made by the middleware as it arrives)."""


def request_scope(req: falcon.asgi.Request) -> RequestScope:
    return req.scope[SCOPE_KEY]


def on_disconnect(req: falcon.asgi.Request, callback: Callable[[], None]) -> None:
    request_scope(req).on_disconnect.append(callback)


def header_priority(req: falcon.asgi.Request) -> str | None:
    """The ``X-Priority`` header's priority class, normalised; None when absent."""
    value = req.get_header("X-Priority")
    return value.strip().lower() if value is not None else None


async def watch_receive(req: falcon.asgi.Request) -> None:
    """Read the ASGI channel after the body so that a client that leaves is noticed."""
    receive = request_scope(req).receive
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def record_of(req: falcon.asgi.Request) -> RequestRecord:
    """The request's record (made by the middleware for the generation routes; made here for a
    plugin's route that generates)."""
    scope = request_scope(req)
    if scope.record is None:
        scope.record = RequestRecord(req.context.request_id, req.path.strip("/") or "generate", time.time_ns())
        scope.state.telemetry.request_arrived(scope.record)
    return scope.record


class DisconnectWatch:
    """ASGI wrapper: gives each HTTP request its :class:`RequestScope`, tells its callbacks the moment
    ``http.disconnect`` arrives, and reports a generation request whose handling ended without
    reporting it (its task was cancelled)."""

    def __init__(self, app: Callable[..., Awaitable[None]], state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Awaitable[Any]], send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def watched_receive() -> Any:
            message = await receive()
            if message["type"] == "http.disconnect":
                callbacks, own.on_disconnect = own.on_disconnect, []
                for callback in callbacks:
                    callback()
            return message

        own = scope[SCOPE_KEY] = RequestScope(self.state, watched_receive)
        try:
            await self.app(scope, watched_receive, send)
        finally:
            if own.record is not None:
                self.state.telemetry.request_failed(own.record, "the request ended without an answer", "cancelled")
