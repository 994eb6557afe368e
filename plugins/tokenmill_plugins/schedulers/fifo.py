"""The ``fifo`` scheduler: first come, first served, within TGI's batch limits and rules.

Waiting requests start in arrival order until the first one that does not fit the
step (:class:`tokenmill.engine.admission.Room`: prefill budget, KV memory, batch size); the
queue never skips ahead, so the head of the line waits for room rather than be
overtaken. While a batch runs, newcomers join it only as TGI lets them
(:func:`tokenmill.engine.admission.joins_now`: enough of them at once, or after
``--max-waiting-tokens`` steps). Preempted sequences go back to the head of the line.
"""

from __future__ import annotations

import tokenmill
from tokenmill.engine.admission import joins_now
from tokenmill.engine.queue import WaitingQueue
from tokenmill.engine.sequence import Sequence
from tokenmill.interfaces import BatchLimits, Scheduler, SchedulerQueue, StepBudget


class FifoQueue(WaitingQueue):
    """Line order (the base class's default): arrival order, requeued sequences first."""

    def __init__(self, limits: BatchLimits) -> None:
        super().__init__(limits)
        self.steps_waited = 0
        """Steps the running batch has run since newcomers last joined it."""

    def admit(self, holding: list[Sequence], budget: StepBudget) -> list[Sequence]:
        ready = self.fitting(holding, budget)
        if not joins_now(len(ready), len(holding), self.steps_waited, self.limits):
            self.steps_waited += 1 if holding else 0
            return []
        self.steps_waited = 0
        return self.take(ready)


class FifoScheduler(Scheduler):
    name = "fifo"
    description = "first come, first served within the prefill, KV-memory and batch-size limits"

    def create(self, limits: BatchLimits) -> SchedulerQueue:
        return FifoQueue(limits)


@tokenmill.hookimpl
def tokenmill_schedulers() -> list[Scheduler]:
    return [FifoScheduler()]
