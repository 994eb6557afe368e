"""What the HTTP side hands the engine thread between two steps: new sequences, cancellations and
chores (a prefix-cache reset, a sleep), behind one lock whose condition also wakes the idle loop."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenmill.engine.sequence import Sequence

log = logging.getLogger(__name__)

IDLE_WAIT_SECONDS = 1.0
"""The longest an idle loop sleeps while it holds sequences that wait for their readers."""

QUEUED_WAIT_SECONDS = 0.1
"""... and while requests wait that do not fit yet, with nothing running."""

ResetDone = Callable[[int], None]
"""Told, from the engine thread, how many cached blocks a reset dropped."""


@dataclass(frozen=True)
class Chore:
    """Work the engine thread does between two steps for another thread, and whom it tells the outcome."""

    run: Callable[[], Any]
    done: Callable[[Any], None]
    refused: Any
    """What ``done`` is told when ``run`` raised, or when the engine stopped before running it."""


class Inbox:
    def __init__(self) -> None:
        self._wake = threading.Condition()
        self._incoming: list[Sequence] = []
        self._cancelled: dict[int, Sequence] = {}
        self._chores: list[Chore] = []
        self.stopping = False
        self.closed = False
        """Set when the loop has ended: later submissions fail at once instead of waiting forever."""

    def submit(self, seq: Sequence) -> bool:
        """Hand over a new sequence; False when the engine has stopped taking any."""
        with self._wake:
            if self.closed:
                return False
            self._incoming.append(seq)
            self._wake.notify()
            return True

    def cancel(self, seq: Sequence) -> None:
        with self._wake:
            seq.cancelled = True
            self._cancelled[seq.id] = seq
            self._wake.notify()

    def ask(self, chore: Chore) -> bool:
        """Have the engine thread do ``chore`` between two steps; False when the engine has stopped (``done``
        is not called)."""
        with self._wake:
            if self.closed:
                return False
            self._chores.append(chore)
            self._wake.notify()
            return True

    def wake(self) -> None:
        """Something the loop may be waiting for changed (a reader took events off its stream)."""
        with self._wake:
            self._wake.notify()

    def stop(self) -> None:
        with self._wake:
            self.stopping = True
            self._wake.notify()

    def take(self) -> tuple[list[Sequence], list[Sequence], list[Chore]]:
        """(Engine thread.) Everything handed over since the last call: new, cancelled, chores."""
        with self._wake:
            incoming, self._incoming = self._incoming, []
            cancelled, self._cancelled = self._cancelled, {}
            chores, self._chores = self._chores, []
        return incoming, list(cancelled.values()), chores

    def close(self) -> list[Sequence]:
        """(At the engine's end.) Take no more; the sequences still handed over (the chores still asked for
        are told they were refused, without running)."""
        with self._wake:
            self.closed = True
            incoming, self._incoming = self._incoming, []
            chores, self._chores = self._chores, []
        for chore in chores:
            tell(chore, chore.refused)
        return incoming

    @staticmethod
    def answer(chores: list[Chore]) -> None:
        """(Engine thread.) Do each chore and tell its caller the outcome; its ``refused`` when it raised,
        since the caller waits for an answer."""
        for chore in chores:
            try:
                outcome = chore.run()
            except Exception:  # noqa: BLE001 - logged; the chore is still answered
                log.exception("an engine chore failed")
                outcome = chore.refused
            tell(chore, outcome)

    def waiting(self) -> list[Sequence]:
        """The sequences handed over and not yet taken."""
        with self._wake:
            return list(self._incoming)

    def __len__(self) -> int:
        return len(self._incoming)

    def wait_for_work(self, holding: bool, queued: bool, idle: bool) -> bool:
        """(Engine thread.) Block until there is something to do; False when the engine is stopping.
        ``holding``: sequences are in the batch; ``queued``: some wait in the scheduler's queue;
        ``idle``: the last step found nothing to run (every running sequence waits for its reader,
        and none waiting fits). None of these change meanwhile: only the engine thread changes them."""
        with self._wake:
            news = self._incoming or self._cancelled or self._chores
            if not news and idle:
                # Sleep until a reader reads, a request arrives or one leaves; wake now and then all
                # the same, for what changes with time alone (a stream's idle timeout, a queue's aging).
                self._wake.wait(IDLE_WAIT_SECONDS if holding else QUEUED_WAIT_SECONDS)
            while not self.stopping and not (self._incoming or self._cancelled or self._chores or holding or queued):
                self._wake.wait()
            return not self.stopping


def tell(chore: Chore, outcome: Any) -> None:
    try:
        chore.done(outcome)
    except Exception:  # noqa: BLE001 - one caller's failure leaves the others answered
        log.exception("answering an engine chore failed")
