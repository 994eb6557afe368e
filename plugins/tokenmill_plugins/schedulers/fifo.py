"""The ``fifo`` scheduler: first come, first served, within TGI's batch limits and rules.

Waiting requests start in arrival order until the first one that does not fit the
step (the engine's admission, :class:`tokenmill.engine.admission.Room`: prefill budget, KV memory,
batch size); the queue never skips ahead, so the head of the line waits for room rather than be
overtaken. While a batch runs, newcomers join it only as TGI lets them
(:func:`tokenmill.engine.admission.joins_now`: enough of them at once, or after
``--max-waiting-tokens`` steps). Preempted sequences go back to the head of the line.
"""

from __future__ import annotations

import tokenmill
from tokenmill.engine.queue import WaitingQueue
from tokenmill.interfaces import BatchLimits, Scheduler, SchedulerQueue


class FifoQueue(WaitingQueue):
    """Line order (the base class's default): arrival order, requeued sequences first; newcomers join a
    running batch by TGI's rule."""

    waits_for_company = True


class FifoScheduler(Scheduler):
    name = "fifo"
    description = "first come, first served within the prefill, KV-memory and batch-size limits"

    def create(self, limits: BatchLimits) -> SchedulerQueue:
        return FifoQueue(limits)


@tokenmill.hookimpl
def tokenmill_schedulers() -> list[Scheduler]:
    return [FifoScheduler()]
