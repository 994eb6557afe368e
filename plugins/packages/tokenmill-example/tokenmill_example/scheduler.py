"""A scheduling policy (tokenmill hooks 2.0) that starts the waiting request with the shortest prompt first."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class ShortestPromptFirstQueue:
    """tokenmill's ``SchedulerQueue`` protocol: called from the engine thread only. tokenmill admits the
    sequences in this order while they fit the step's limits."""

    def __init__(self, limits: Any) -> None:
        self.limits = limits
        self.waiting: list[Any] = []

    def add(self, seq: Any) -> None:
        self.waiting.append(seq)

    def prepend(self, seq: Any) -> None:  # a preempted sequence competes again by its length
        self.waiting.append(seq)

    def peek(self) -> Any:
        return min(self.waiting, key=lambda s: (s.pending_len, s.arrived_at))

    def pop(self) -> Any:
        seq = self.peek()
        self.waiting.remove(seq)
        return seq

    def remove(self, seq: Any) -> bool:
        if seq not in self.waiting:
            return False
        self.waiting.remove(seq)
        return True

    def __len__(self) -> int:
        return len(self.waiting)

    def __iter__(self) -> Iterator[Any]:
        return iter(sorted(self.waiting, key=lambda s: (s.pending_len, s.arrived_at)))
