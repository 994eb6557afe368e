"""The responses kept for ``previous_response_id`` and ``GET /v1/responses/{id}``: in memory, the
least recently used dropped beyond a bound, so that a long-running server's memory stays flat."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

CAPACITY = 1000
"""Responses kept (each its JSON and its conversation's messages)."""


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]
    conversation: list[dict[str, Any]]
    """The chat messages up to and including this response's answer, for the next turn."""


class ResponseStore:
    """Read on validation workers, written on the event loop: every access holds the lock."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._kept: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        with self._lock:
            self._kept[response_id] = stored
            self._kept.move_to_end(response_id)
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            stored = self._kept.get(response_id)
            if stored is not None:
                self._kept.move_to_end(response_id)
            return stored
