"""The engine's calls into the scheduler plugin, each guarded. A call that raises is counted (the
step counts as failed) and logged, and never loses a sequence silently: ``add`` reports it so the
engine fails that sequence, ``admit`` and ``requeue`` leave orphans that the engine's registry of
live sequences finds and ends, ``preempt`` preempts nothing, ``drain`` and ``pending`` answer none
(the registry still knows every sequence). The contract is in the scheduler hook's documentation."""

from __future__ import annotations

import logging

from tokenmill.engine.sequence import Sequence
from tokenmill.interfaces import Preemption, SchedulerQueue, StepBudget

log = logging.getLogger(__name__)


class GuardedQueue:
    def __init__(self, queue: SchedulerQueue) -> None:
        self.queue = queue
        self.faults = 0
        """Calls that raised so far."""

    def fault(self, call: str, error: Exception) -> None:
        self.faults += 1
        log.error("the scheduler's %s raised %s: %s", call, type(error).__name__, error, exc_info=error)

    def add(self, seq: Sequence) -> bool:
        """Hand a new sequence to the scheduler; False when that raised (the sequence is not queued)."""
        try:
            self.queue.add(seq)
            return True
        except Exception as error:  # noqa: BLE001 - this sequence fails, the others go on
            self.fault("add", error)
            return False

    def remove(self, seq: Sequence) -> None:
        """Take a cancelled sequence out (if that raises, one admitted later is skipped as cancelled)."""
        try:
            self.queue.remove(seq)
        except Exception as error:  # noqa: BLE001
            self.fault("remove", error)

    def requeue(self, seq: Sequence) -> None:
        """Give ``seq`` back to the scheduler; if that raises, ``seq`` is orphaned (the engine ends it)."""
        try:
            self.queue.requeue(seq)
        except Exception as error:  # noqa: BLE001 - a faulty plugin fails the sequence, not the engine
            self.fault("requeue", error)

    def admit(self, holding: list[Sequence], budget: StepBudget) -> list[Sequence]:
        """The sequences to start now; none when ``admit`` raised (what it took is orphaned)."""
        try:
            return list(self.queue.admit(holding, budget))
        except Exception as error:  # noqa: BLE001
            self.fault("admit", error)
            return []

    def preempt(self, holding: list[Sequence], budget: StepBudget) -> list[Preemption]:
        """The running sequences to set aside (a queue without ``preempt``, or one that raised: none)."""
        choose = getattr(self.queue, "preempt", None)
        if choose is None:
            return []
        try:
            return list(choose(holding, budget))
        except Exception as error:  # noqa: BLE001 - no preemption this step
            self.fault("preempt", error)
            return []

    def drain(self) -> list[Sequence]:
        """Every waiting sequence, taken from the queue; none when that raised."""
        try:
            return list(self.queue.drain())
        except Exception as error:  # noqa: BLE001
            self.fault("drain", error)
            return []

    def pending(self) -> list[Sequence]:
        """The waiting sequences in admission order; none when the queue cannot say."""
        pending = getattr(self.queue, "pending", None)
        try:
            return list(pending()) if pending else []
        except Exception:  # noqa: BLE001 - /queue shows none waiting rather than the loop failing
            return []
