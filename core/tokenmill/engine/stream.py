"""The one hand-off between the engine thread and its readers: a request's token stream.

The engine pushes each sequence's events (tokens, then a final result or an error) into the
stream its request was submitted with, tagged with the sequence's choice index (a request with
``n`` or ``best_of`` runs several sequences into one stream). The HTTP side reads the stream on
its event loop; ``unsent`` is what backpressure reads: a sequence whose reader lags that many
events behind pauses, keeping its KV memory, until the reader catches up.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tokenmill.engine.sequence import Event

log = logging.getLogger(__name__)

EventSink = Callable[["Event"], None]


class EventStream(Protocol):
    """Where the engine writes a sequence's events (from the engine thread)."""

    def push(self, choice: int, event: Event) -> None:
        """Hand over ``event`` of the sequence with index ``choice``; never blocks."""

    def unsent(self) -> int:
        """Events pushed that the reader has not sent on (or consumed) yet."""


class StreamClosed(Exception):
    """The reader's side ended (the client disconnected) before the stream did."""


class TokenStream:
    """A thread-safe stream of (choice, event) pairs from the engine thread to one asyncio reader.

    Create it on the event loop that reads it. The reader awaits :meth:`next`, and calls
    :meth:`sent` once it has written an event to its client; :meth:`close` (the client left)
    wakes a waiting reader with :class:`StreamClosed`.
    """

    def __init__(self, paced: bool = True, on_sent: Callable[[], None] | None = None,
                 on_error: Callable[[], None] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self.paced = paced
        """False: the reader takes every event as it comes (a whole response), so its sequence never
        pauses for it; ``unsent`` is then 0."""
        self.on_sent = on_sent
        """Called when the reader has sent an event (``Engine.wake``: a sequence paused for it may go on)."""
        self.on_error = on_error
        """Called on the event loop as soon as an error event arrives, before the reader gets to it (which a
        reader stuck writing to a client that reads nothing never does): the request's slot is given back."""
        self._queue: asyncio.Queue[tuple[int, Event] | None] = asyncio.Queue()
        self._pushed = 0
        """Written by the engine thread only."""
        self._sent = 0
        """Written by the event loop only."""

    def push(self, choice: int, event: Event) -> None:
        self._pushed += 1
        self._loop.call_soon_threadsafe(self._queue.put_nowait, (choice, event))
        if self.on_error is not None and getattr(event, "error_type", None) is not None:
            self._loop.call_soon_threadsafe(self.on_error)

    def unsent(self) -> int:
        return self._pushed - self._sent if self.paced else 0

    async def next(self) -> tuple[int, Event]:
        """The next (choice, event) pair; raises :class:`StreamClosed` once the stream is closed."""
        item = await self._queue.get()
        if item is None:
            self._queue.put_nowait(None)  # every later reader hears it too
            raise StreamClosed
        return item

    def sent(self) -> None:
        """The reader has written the last event it took to its client."""
        self._sent += 1
        if self.on_sent is not None:
            self.on_sent()

    def close(self) -> None:
        """The reader's side ended (event loop only)."""
        self._queue.put_nowait(None)


class CallbackStream:
    """An :class:`EventStream` that calls ``sink`` with each event in the engine thread (for
    warm-up, tests and benchmarks that read the engine directly, without an event loop)."""

    def __init__(self, sink: EventSink, unsent: Callable[[], int] | None = None) -> None:
        self.sink = sink
        self._unsent = unsent

    def push(self, choice: int, event: Event) -> None:
        self.sink(event)

    def unsent(self) -> int:
        return self._unsent() if self._unsent is not None else 0


def as_stream(target: EventStream | EventSink) -> EventStream:
    """``target`` as an :class:`EventStream`: a plain callable receives each event."""
    if hasattr(target, "push") and hasattr(target, "unsent"):
        return target  # type: ignore[return-value]
    return CallbackStream(target)  # type: ignore[arg-type]
