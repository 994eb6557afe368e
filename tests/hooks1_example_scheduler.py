"""tokenmill-example's scheduler queue as it was written for hooks 1.0 (its own ``admit``), kept as it was:
tokenmill 2.0 still runs such a queue, through its adapter (``tokenmill.engine.scheduling.LegacyAdmission``)."""

from __future__ import annotations

from typing import Any

from tokenmill.admission import Room


class ShortestPromptFirstQueue:
    """tokenmill's ``SchedulerQueue`` protocol: called from the engine thread only."""

    def __init__(self, limits: Any) -> None:
        self.limits = limits
        self.waiting: list[Any] = []

    def add(self, seq: Any) -> None:
        self.waiting.append(seq)

    def requeue(self, seq: Any) -> None:  # a preempted sequence competes again by its length
        self.waiting.append(seq)

    def remove(self, seq: Any) -> bool:
        if seq not in self.waiting:
            return False
        self.waiting.remove(seq)
        return True

    def __len__(self) -> int:
        return len(self.waiting)

    def pending(self) -> list[Any]:
        return sorted(self.waiting, key=lambda s: (s.pending_len, s.arrived_at))

    def drain(self) -> list[Any]:
        drained, self.waiting = self.waiting, []
        return drained

    def admit(self, holding: list[Any], budget: Any) -> list[Any]:
        """The shortest waiting sequences that fit the step, until the first that does not."""
        room, started = Room(self.limits, holding, budget), []
        for seq in self.pending():
            if not room.fits(seq):
                break
            room.take(seq)
            started.append(seq)
        chosen = {id(s) for s in started}
        self.waiting = [s for s in self.waiting if id(s) not in chosen]
        return started
