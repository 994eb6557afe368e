"""The waiting line every scheduler needs, written once: subclass :class:`WaitingQueue` and supply the order.

A scheduler's queue (:class:`tokenmill.interfaces.SchedulerQueue`) keeps the sequences that wait
to start and decides which start now. :class:`WaitingQueue` does the keeping (``add``,
``requeue``, ``remove``, ``__len__``, ``drain``, ``pending``); a subclass says only in what order
the waiting sequences are considered, and, if it wants more than "start them in that order while
they fit", how they are admitted::

    from tokenmill.engine.queue import WaitingQueue

    class ShortestPromptFirst(WaitingQueue):
        def key(self, seq):
            return seq.pending_len

``admit`` then starts the shortest waiting prompts that fit the step (see :meth:`WaitingQueue.fitting`),
and ``pending()`` (``GET /queue``) lists them in the same order.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from tokenmill.engine.admission import Room
from tokenmill.engine.sequence import Sequence
from tokenmill.interfaces import BatchLimits, SchedulerQueue, StepBudget


class WaitingQueue(SchedulerQueue):
    """The waiting sequences of one engine, in a line, and the bookkeeping of the queue protocol.

    The line (:attr:`waiting`) holds new sequences at its tail (``add``) and sequences that
    were preempted, suspended or could not start after all at its head (``requeue``: the most
    recently requeued first), so in line order they go before those that never ran.

    To subclass, override one of:

    - :meth:`key`: a sort key of one sequence, lower first; the sort is stable, so sequences with
      equal keys keep line order (requeued first, then by arrival);
    - :meth:`ordered`: the whole admission order at once (when the key needs a value computed
      once per ordering, such as the time now).

    and, optionally, :meth:`admit`: the default starts the sequences in that order until the
    first that does not fit the step (:meth:`fitting`), and removes them from the queue
    (:meth:`take`). A queue that also defines ``preempt(running, budget)`` is asked each step
    which running sequences to set aside (the base class defines none). Never change
    :attr:`waiting` except through these methods. Called from the engine thread only
    (``__len__`` from anywhere).
    """

    def __init__(self, limits: BatchLimits) -> None:
        self.limits = limits
        self.waiting: deque[Sequence] = deque()
        """The line: requeued sequences at the head, new ones at the tail."""

    # ---- what a subclass supplies ---------------------------------------------------------------

    def key(self, seq: Sequence) -> Any:
        """Where ``seq`` goes in the admission order: lower first, ties in line order. The default
        (the same for all) keeps line order: first come, first served, requeued ones first."""
        return 0

    def ordered(self) -> list[Sequence]:
        """The waiting sequences in the order :meth:`admit` considers them (the line sorted by :meth:`key`)."""
        return sorted(self.waiting, key=self.key)

    def admit(self, holding: list[Sequence], budget: StepBudget) -> list[Sequence]:
        """The waiting sequences to start now, removed from the queue: by default those that fit the
        step in :meth:`ordered` order, up to the first that does not (none skips ahead of it)."""
        return self.take(self.fitting(holding, budget))

    # ---- helpers for admit ----------------------------------------------------------------------

    def fitting(self, holding: list[Sequence], budget: StepBudget) -> list[Sequence]:
        """The leading sequences of :meth:`ordered` that fit one step together
        (:class:`tokenmill.engine.admission.Room`), up to the first that does not; the queue is not changed."""
        room, fit = Room(self.limits, holding, budget), []
        for seq in self.ordered():
            if not room.fits(seq):
                break
            room.take(seq)
            fit.append(seq)
        return fit

    def take(self, seqs: list[Sequence]) -> list[Sequence]:
        """Remove ``seqs`` (waiting sequences) from the queue; returns them, for ``return self.take(...)``."""
        if seqs:
            chosen = {id(s) for s in seqs}
            self.waiting = deque(s for s in self.waiting if id(s) not in chosen)
        return seqs

    # ---- the queue protocol -----------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """A new sequence joins the tail of the line."""
        self.waiting.append(seq)

    def requeue(self, seq: Sequence) -> None:
        """A sequence that ran (preempted or suspended) or could not start after all goes to the head
        of the line; it keeps its ``arrived_at``."""
        self.waiting.appendleft(seq)

    def remove(self, seq: Sequence) -> bool:
        """Take ``seq`` out of the line (a cancelled request); False when it was not waiting."""
        for index, waiting in enumerate(self.waiting):
            if waiting is seq:
                del self.waiting[index]
                return True
        return False

    def __len__(self) -> int:
        return len(self.waiting)

    def drain(self) -> list[Sequence]:
        """Remove and return every waiting sequence, in line order (at shutdown)."""
        drained = list(self.waiting)
        self.waiting.clear()
        return drained

    def pending(self) -> list[Sequence]:
        """The waiting sequences in the order :meth:`admit` considers them; the queue is not changed."""
        return self.ordered()
