"""``--scheduler faulty-fifo``: first come, first served under TGI's rules (as the built-in ``fifo``),
whose queue methods raise when the control file says so.

It is a hooks 1.x queue (its own ``admit``, ``requeue``, ``drain`` and ``preempt``), so it also checks that
such a queue still runs, through tokenmill's adapter. It is written from tokenmill's public pieces
(``WaitingQueue`` keeps the line, ``joins_now`` is TGI's rule for joining a running batch), not by
importing the ``fifo`` plugin.
"""

from __future__ import annotations

from tokenmill.engine.admission import joins_now
from tokenmill.engine.queue import WaitingQueue
from tokenmill.engine.sequence import Sequence
from tokenmill.interfaces import BatchLimits, Preemption, Scheduler, SchedulerQueue, StepBudget
from tokenmill_faults.control import CONTROL, Control, InjectedFault


class FaultyFifoQueue(WaitingQueue):
    """Arrival order, requeued sequences first; every method asks the control file first."""

    def __init__(self, limits: BatchLimits, control: Control = CONTROL) -> None:
        super().__init__(limits)
        self.control = control
        self.steps_waited = 0

    def admit(self, holding: list[Sequence], budget: StepBudget) -> list[Sequence]:
        self.control.note("admit")
        if len(self.waiting) and self.control.take("admit_raise"):
            raise InjectedFault("injected fault in admit (nothing taken)")
        ready = self.fitting(holding, budget)
        if not joins_now(len(ready), len(holding), self.steps_waited, self.limits):
            self.steps_waited += 1 if holding else 0
            return []
        self.steps_waited = 0
        taken = self.take(ready)
        if taken and self.control.take("admit_raise_after_take"):
            raise InjectedFault(f"injected fault in admit (after taking {len(taken)} sequences off the queue)")
        return taken

    def preempt(self, running: list[Sequence], budget: StepBudget) -> list[Preemption]:
        self.control.note("preempt")
        if self.control.take("preempt_raise"):
            raise InjectedFault("injected fault in preempt")
        if running and self.control.take("preempt"):
            return [Preemption(max(running, key=lambda s: (s.arrived_at, s.id)), keep_kv=False)]
        if running and self.control.take("suspend"):
            return [Preemption(max(running, key=lambda s: (s.arrived_at, s.id)), keep_kv=True)]
        return []

    def requeue(self, seq: Sequence) -> None:
        self.control.note("requeue")
        if self.control.take("requeue_raise"):
            raise InjectedFault(f"injected fault in requeue (sequence {seq.id} not put back)")
        super().requeue(seq)

    def remove(self, seq: Sequence) -> bool:
        self.control.note("remove")
        if self.control.take("remove_raise"):
            raise InjectedFault("injected fault in remove")
        return super().remove(seq)

    def drain(self) -> list[Sequence]:
        self.control.note("drain")
        if self.control.take("drain_raise"):
            raise InjectedFault(f"injected fault in drain ({len(self.waiting)} sequences waiting)")
        return super().drain()


class FaultyFifo(Scheduler):
    name = "faulty-fifo"
    description = "fifo whose queue raises on demand ($TOKENMILL_FAULTS; tokenmill-faults, for tests)"

    def create(self, limits: BatchLimits) -> SchedulerQueue:
        return FaultyFifoQueue(limits)
