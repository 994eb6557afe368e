"""The engine's side of scheduling: admission within the step's limits, over the order the scheduler
plugin's queue (a policy, hooks 2.0) gives, and every call into that queue guarded.

A call that raises is counted (the step counts as failed) and logged, and never loses a sequence
silently: ``add`` reports it so the engine fails that sequence, a ``pop`` or ``prepend`` that raised
leaves an orphan that the engine's registry of live sequences finds and ends, ``choose_victim``
preempts nothing, and draining or listing the queue answers none (the registry still knows every
sequence). A hooks 1.x queue (one with its own ``admit``) runs through :class:`LegacyAdmission`.
The contract is in the scheduler hook's documentation."""

from __future__ import annotations

import logging
from typing import Any

from tokenmill.engine.admission import Room, joins_now
from tokenmill.engine.sequence import Sequence
from tokenmill.interfaces import BatchLimits, Preemption, SchedulerQueue, StepBudget

log = logging.getLogger(__name__)


class Admission:
    """The scheduler plugin's queue as the engine uses it: what starts this step, what is set aside."""

    def __init__(self, queue: SchedulerQueue, limits: BatchLimits) -> None:
        self.queue = queue
        self.limits = limits
        self.faults = 0
        """Calls into the queue that raised so far."""
        self.steps_waited = 0
        """Steps the running batch has run since newcomers last joined it (TGI's rule)."""

    @staticmethod
    def of(queue: Any, limits: BatchLimits | None = None) -> Admission:
        """The admission over ``queue``: a policy (hooks 2.0), a hooks 1.x queue, or an admission already;
        ``limits`` default to the queue's own."""
        if isinstance(queue, Admission):
            return queue
        limits = limits if limits is not None else queue.limits
        legacy = callable(getattr(queue, "admit", None))  # a hooks 1.x queue admits by itself
        return (LegacyAdmission if legacy else Admission)(queue, limits)

    def fault(self, call: str, error: Exception) -> None:
        self.faults += 1
        log.error("the scheduler's %s raised %s: %s", call, type(error).__name__, error, exc_info=error)

    def __len__(self) -> int:
        return len(self.queue)

    def add(self, seq: Sequence) -> bool:
        """Hand a new sequence to the scheduler; False when that raised (the sequence is not queued)."""
        try:
            self.queue.add(seq)
            return True
        except Exception as error:  # noqa: BLE001 - this sequence fails, the others go on
            self.fault("add", error)
            return False

    def remove(self, seq: Sequence) -> bool:
        """Take a cancelled sequence out; False when it was not waiting or that raised (then one
        admitted later is skipped as cancelled)."""
        try:
            return bool(self.queue.remove(seq))
        except Exception as error:  # noqa: BLE001
            self.fault("remove", error)
            return False

    def requeue(self, seq: Sequence) -> None:
        """Give ``seq`` back to the scheduler, ahead of new ones; if that raises, ``seq`` is orphaned."""
        try:
            self.queue.prepend(seq)
        except Exception as error:  # noqa: BLE001 - a faulty plugin fails the sequence, not the engine
            self.fault("prepend", error)

    def admit(self, holding: list[Sequence], budget: StepBudget) -> list[Sequence]:
        """The sequences to start now, taken off the queue in its order while they fit one step together
        (:class:`Room`), up to the first that does not; none skips ahead of it. For a policy that
        ``waits_for_company``, newcomers join a running batch only by TGI's rule (:func:`joins_now`)."""
        room, ready = Room(self.limits, holding, budget), []
        try:
            for _ in range(len(self.queue)):  # bounded, whatever the policy's pop does
                if not room.fits(seq := self.queue.peek()):
                    break
                room.take(seq)
                ready.append(self.queue.pop())
        except Exception as error:  # noqa: BLE001 - what was taken starts; one popped as it raised is orphaned
            self.fault("peek/pop", error)
            return ready
        if getattr(self.queue, "waits_for_company", False) and not joins_now(
                len(ready), len(holding), self.steps_waited, self.limits):
            self.steps_waited += 1 if holding else 0
            for seq in reversed(ready):
                self.requeue(seq)
            return []
        self.steps_waited = 0
        return ready

    def preempt(self, holding: list[Sequence], budget: StepBudget) -> list[Preemption]:
        """The running sequence the policy sets aside for the next waiting one, if it chooses any."""
        choose = getattr(self.queue, "choose_victim", None)
        if choose is None or not holding or not len(self.queue):
            return []
        try:
            waiting = self.queue.peek()
            victim = choose(holding, waiting, Room(self.limits, holding, budget).shortage(waiting))
        except Exception as error:  # noqa: BLE001 - no preemption this step
            self.fault("choose_victim", error)
            return []
        return [victim] if victim is not None else []

    def drain(self) -> list[Sequence]:
        """Every waiting sequence, taken from the queue; those taken before a call raised."""
        drained: list[Sequence] = []
        try:
            for _ in range(len(self.queue)):
                drained.append(self.queue.pop())
        except Exception as error:  # noqa: BLE001
            self.fault("pop", error)
        return drained

    def listing(self) -> list[Sequence]:
        """The waiting sequences in the order they start, as the queue lists them (it may raise)."""
        return list(self.queue)

    def pending(self) -> list[Sequence]:
        """The waiting sequences in the order they start; none when the queue cannot say (read every step
        for ``GET /queue``, so a failure here is not logged)."""
        try:
            return self.listing()
        except Exception:  # noqa: BLE001 - /queue shows none waiting rather than the loop failing
            return []

    def knows_pending(self) -> list[Sequence] | None:
        """The waiting sequences in the order they start, or None when the queue cannot say (it raised)."""
        try:
            return self.listing()
        except Exception:  # noqa: BLE001 - a faulty plugin: what waits is unknown
            log.exception("listing the scheduler's queue raised")
            return None


class LegacyAdmission(Admission):
    """A hooks 1.x queue (``add``, ``requeue``, ``remove``, ``__len__``, ``drain``, ``pending()``,
    ``admit(holding, budget)`` and an optional ``preempt(running, budget)``), which admits by its own
    rules: the engine calls those methods, guarded as a policy's are."""

    def requeue(self, seq: Sequence) -> None:
        try:
            self.queue.requeue(seq)
        except Exception as error:  # noqa: BLE001
            self.fault("requeue", error)

    def admit(self, holding: list[Sequence], budget: StepBudget) -> list[Sequence]:
        try:
            return list(self.queue.admit(holding, budget))
        except Exception as error:  # noqa: BLE001 - what it took is orphaned
            self.fault("admit", error)
            return []

    def preempt(self, holding: list[Sequence], budget: StepBudget) -> list[Preemption]:
        choose = getattr(self.queue, "preempt", None)
        if choose is None:
            return []
        try:
            return list(choose(holding, budget))
        except Exception as error:  # noqa: BLE001 - no preemption this step
            self.fault("preempt", error)
            return []

    def drain(self) -> list[Sequence]:
        try:
            return list(self.queue.drain())
        except Exception as error:  # noqa: BLE001
            self.fault("drain", error)
            return []

    def listing(self) -> list[Sequence]:
        return list(self.queue.pending())  # a queue without pending() cannot say what waits
