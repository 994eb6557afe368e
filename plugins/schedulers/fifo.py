"""The ``fifo`` scheduler: first come, first served, within TGI's batch limits and rules.

Waiting requests start in arrival order until the first one that does not fit the
step (:class:`tokenmill.engine.admission.Room`: prefill budget, KV memory, batch size); the
queue never skips ahead, so the head of the line waits for room rather than be
overtaken. While a batch runs, newcomers join it only as TGI lets them
(:func:`tokenmill.engine.admission.joins_now`: enough of them at once, or after
``--max-waiting-tokens`` steps). Preempted sequences go back to the head of the line.
"""

from __future__ import annotations

from collections import deque

import tokenmill
from tokenmill.engine.admission import Room, joins_now
from tokenmill.interfaces import BatchLimits, Scheduler, SchedulerQueue, StepBudget
from tokenmill.engine.sequence import Sequence


class FifoQueue(SchedulerQueue):
    def __init__(self, limits: BatchLimits) -> None:
        self.limits = limits
        self.waiting: deque[Sequence] = deque()
        self.steps_waited = 0
        """Steps the running batch has run since newcomers last joined it."""

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def requeue(self, seq: Sequence) -> None:
        self.waiting.appendleft(seq)

    def remove(self, seq: Sequence) -> bool:
        try:
            self.waiting.remove(seq)
            return True
        except ValueError:
            return False

    def __len__(self) -> int:
        return len(self.waiting)

    def drain(self) -> list[Sequence]:
        drained = list(self.waiting)
        self.waiting.clear()
        return drained

    def pending(self) -> list[Sequence]:
        return list(self.waiting)

    def admit(self, holding: list[Sequence], budget: StepBudget) -> list[Sequence]:
        room = Room(self.limits, holding, budget)
        ready = 0
        for seq in self.waiting:
            if not room.fits(seq):
                break
            room.take(seq)
            ready += 1
        if not joins_now(ready, len(holding), self.steps_waited, self.limits):
            self.steps_waited += 1 if holding else 0
            return []
        self.steps_waited = 0
        return [self.waiting.popleft() for _ in range(ready)]


class FifoScheduler(Scheduler):
    name = "fifo"
    description = "first come, first served within the prefill, KV-memory and batch-size limits"

    def create(self, limits: BatchLimits) -> SchedulerQueue:
        return FifoQueue(limits)


@tokenmill.hookimpl
def tokenmill_schedulers() -> list[Scheduler]:
    return [FifoScheduler()]
