"""The waiting line every scheduling policy needs, written once: subclass :class:`WaitingQueue` and supply the order.

A scheduler's queue (:class:`tokenmill.interfaces.SchedulerQueue`, hooks 2.0) keeps the sequences that
wait and says which starts next; the engine decides whether it fits the step. :class:`WaitingQueue`
does the keeping (``add``, ``prepend``, ``peek``, ``pop``, ``remove``, ``__len__``, ``__iter__``); a
subclass says only in what order the waiting sequences start::

    from tokenmill.engine.queue import WaitingQueue

    class ShortestPromptFirst(WaitingQueue):
        def key(self, seq):
            return seq.pending_len

The engine then starts the shortest waiting prompts that fit the step, and ``GET /queue`` lists them
in the same order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

from tokenmill.engine.admission import Room
from tokenmill.engine.sequence import Sequence
from tokenmill.interfaces import BatchLimits, SchedulerQueue, StepBudget


class WaitingQueue(SchedulerQueue):
    """The waiting sequences of one engine, in a line, and the bookkeeping of the queue protocol.

    The line (:attr:`waiting`) holds new sequences at its tail (``add``) and sequences that were
    preempted, suspended or could not start after all at its head (``prepend``: the most recently
    prepended first), so in line order they go before those that never ran.

    To subclass, override one of:

    - :meth:`key`: a sort key of one sequence, lower first; the sort is stable, so sequences with
      equal keys keep line order (prepended first, then by arrival);
    - :meth:`ordered`: the whole order at once (when the key needs a value computed once per
      ordering, such as the time now).

    A subclass may also define ``choose_victim`` and ``waits_for_company`` (see the protocol). A hooks
    1.x subclass that defines its own ``admit`` keeps its helpers (``fitting``, ``take``, ``requeue``,
    ``drain``, ``pending``) and is admitted through it. Never
    change :attr:`waiting` except through these methods. Called from the engine thread only
    (``__len__`` from anywhere).
    """

    def __init__(self, limits: BatchLimits) -> None:
        self.limits = limits
        self.waiting: deque[Sequence] = deque()
        """The line: prepended sequences at the head, new ones at the tail."""

    # ---- what a subclass supplies ---------------------------------------------------------------

    def key(self, seq: Sequence) -> Any:
        """Where ``seq`` goes in the order: lower first, ties in line order. The default (the same
        for all) keeps line order: first come, first served, prepended ones first."""
        return 0

    def ordered(self) -> list[Sequence]:
        """The waiting sequences in the order they start (the line sorted by :meth:`key`)."""
        return sorted(self.waiting, key=self.key)

    # ---- the queue protocol -----------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """A new sequence joins the tail of the line."""
        self.waiting.append(seq)

    def prepend(self, seq: Sequence) -> None:
        """A sequence that ran (preempted or suspended) or could not start after all goes to the head
        of the line; it keeps its ``arrived_at``."""
        self.waiting.appendleft(seq)

    def peek(self) -> Sequence:
        return self.ordered()[0]

    def pop(self) -> Sequence:
        seq = self.peek()
        self.remove(seq)
        return seq

    def remove(self, seq: Sequence) -> bool:
        """Take ``seq`` out of the line (a cancelled request); False when it was not waiting."""
        for index, waiting in enumerate(self.waiting):
            if waiting is seq:
                del self.waiting[index]
                return True
        return False

    def __len__(self) -> int:
        return len(self.waiting)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self.ordered())

    # ---- hooks 1.x: what a subclass with its own ``admit`` built on ------------------------------------

    def fitting(self, holding: list[Sequence], budget: StepBudget) -> list[Sequence]:
        """The leading sequences of :meth:`ordered` that fit one step together (:class:`Room`), up to the
        first that does not; the queue is not changed."""
        room, fit = Room(self.limits, holding, budget), []
        for seq in self.ordered():
            if not room.fits(seq):
                break
            room.take(seq)
            fit.append(seq)
        return fit

    def take(self, seqs: list[Sequence]) -> list[Sequence]:
        """Remove ``seqs`` (waiting sequences) from the queue; returns them."""
        for seq in seqs:
            self.remove(seq)
        return seqs

    def requeue(self, seq: Sequence) -> None:
        self.prepend(seq)

    def drain(self) -> list[Sequence]:
        drained = list(self.waiting)
        self.waiting.clear()
        return drained

    def pending(self) -> list[Sequence]:
        return self.ordered()
