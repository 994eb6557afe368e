"""What the HTTP side hands the engine thread between two steps: new sequences, cancellations and
prefix-cache resets, behind one lock whose condition also wakes the idle loop."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from tokenmill.engine.sequence import Sequence

log = logging.getLogger(__name__)

IDLE_WAIT_SECONDS = 1.0
"""The longest an idle loop sleeps while it holds sequences that wait for their readers."""

QUEUED_WAIT_SECONDS = 0.1
"""... and while requests wait that do not fit yet, with nothing running."""

ResetDone = Callable[[int], None]
"""Told, from the engine thread, how many cached blocks a reset dropped."""


class Inbox:
    def __init__(self) -> None:
        self._wake = threading.Condition()
        self._incoming: list[Sequence] = []
        self._cancelled: dict[int, Sequence] = {}
        self._resets: list[ResetDone] = []
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

    def reset(self, done: ResetDone) -> bool:
        """Ask for a prefix-cache reset; False when the engine has stopped (``done`` is not called)."""
        with self._wake:
            if self.closed:
                return False
            self._resets.append(done)
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

    def take(self) -> tuple[list[Sequence], list[Sequence], list[ResetDone]]:
        """(Engine thread.) Everything handed over since the last call: new, cancelled, resets."""
        with self._wake:
            incoming, self._incoming = self._incoming, []
            cancelled, self._cancelled = self._cancelled, {}
            resets, self._resets = self._resets, []
        return incoming, list(cancelled.values()), resets

    def close(self) -> list[Sequence]:
        """(Engine thread, at its end.) Take no more; the sequences still handed over (the resets still
        asked for are told that nothing was dropped)."""
        with self._wake:
            self.closed = True
            incoming, self._incoming = self._incoming, []
            resets, self._resets = self._resets, []
        self.answer(resets, lambda: 0)
        return incoming

    @staticmethod
    def answer(resets: list[ResetDone], drop: Callable[[], int]) -> None:
        """(Engine thread.) Drop the cached prefixes once per reset in ``resets`` and tell it how many;
        0 when dropping raised, since the reset's caller waits for an answer."""
        for done in resets:
            try:
                dropped = drop()
            except Exception:  # noqa: BLE001 - logged; the reset is still answered
                log.exception("resetting the prefix cache failed")
                dropped = 0
            try:
                done(dropped)
            except Exception:  # noqa: BLE001 - one caller's failure leaves the others answered
                log.exception("answering a prefix-cache reset failed")

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
            news = self._incoming or self._cancelled or self._resets
            if not news and idle:
                # Sleep until a reader reads, a request arrives or one leaves; wake now and then all
                # the same, for what changes with time alone (a stream's idle timeout, a queue's aging).
                self._wake.wait(IDLE_WAIT_SECONDS if holding else QUEUED_WAIT_SECONDS)
            while not self.stopping and not (self._incoming or self._cancelled or self._resets or holding or queued):
                self._wake.wait()
            return not self.stopping
