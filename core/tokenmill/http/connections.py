"""Bounds on connections before a route sees them: how long a client may take to send a request's
headers, how large they may be, and how many connections the server holds at once.

uvicorn bounds the time between requests on a kept-alive connection, but not the time a request's
headers take: a client that opens connections and sends a header line now and then would hold
them forever. The protocol here gives each request's headers ``--body-read-timeout`` (the deadline
its body gets too) and closes the connection when they are late."""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from tokenmill.config import Config

MAX_HEADER_BYTES = 64 * 1024
"""The most bytes a request's line and headers may take (h11 answers 400 beyond)."""


class HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, with a deadline on each request's headers: from the connection's
    start, or from the first byte of a later request on it, to the end of its headers."""

    header_timeout: float = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.arm_header_deadline()  # a request's headers are on their way
        elif self.header_deadline is not None:
            self.header_deadline.cancel()
            self.header_deadline = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
        super().connection_lost(exc)

    def arm_header_deadline(self) -> None:
        if self.header_deadline is None:
            self.header_deadline = self.loop.call_later(self.header_timeout, self.headers_late)

    def headers_late(self) -> None:
        self.header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def connection_settings(config: Config) -> dict[str, Any]:
    """uvicorn's settings that bound connections for ``config``: the protocol with the header
    deadline, the header size, and at most four connections per concurrent request (streams, idle
    kept-alive connections, probes) plus 256; beyond, uvicorn answers 503 at once."""
    protocol = type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,),
                    {"header_timeout": config.body_read_timeout})
    return {"http": protocol, "h11_max_incomplete_event_size": MAX_HEADER_BYTES,
            "limit_concurrency": 4 * config.max_concurrent_requests + 256}
