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

HANDED_SLOT = "slot"
"""The ``req.context`` key of a concurrency place a dispatching route took and hands over."""

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
    tenant: str | None = None
    """Who sent it, named by the API key it came with (None: the server asks for no key)."""
    may_set_priority: bool = True
    """Whether its key may set its priority (``--priority-header-keys``)."""


def request_scope(req: falcon.asgi.Request) -> RequestScope:
    return req.scope[SCOPE_KEY]


def on_disconnect(req: falcon.asgi.Request, callback: Callable[[], None]) -> None:
    request_scope(req).on_disconnect.append(callback)


@dataclass(frozen=True)
class Caller:
    """What a generation request's headers say of who sent it, as validation needs it."""

    priority: str | None = None
    """The ``X-Priority`` header's class (None: absent, or not the key's to set)."""
    tenant: str | None = None
    """:attr:`RequestScope.tenant`."""
    may_set_priority: bool = True


def caller_of(req: falcon.asgi.Request) -> Caller:
    scope = request_scope(req)
    return Caller(header_priority(req), scope.tenant, scope.may_set_priority)


def header_priority(req: falcon.asgi.Request) -> str | None:
    """The ``X-Priority`` header's priority class, normalised; None when absent or empty, or when the
    request's key may not set its priority (a gateway may add the header to every request)."""
    value = req.get_header("X-Priority")
    if value is None or not value.strip() or not request_scope(req).may_set_priority:
        return None
    return value.strip().lower()


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
