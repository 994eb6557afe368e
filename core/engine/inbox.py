"""What the HTTP side hands the engine thread between two steps: new sequences, cancellations and
prefix-cache resets, behind one lock whose condition also wakes the idle loop."""

from __future__ import annotations

import threading
from collections.abc import Callable

from tokenmill.engine.sequence import Sequence

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

    def close(self) -> tuple[list[Sequence], list[ResetDone]]:
        """(Engine thread, at its end.) Take no more; the sequences and resets still handed over."""
        with self._wake:
            self.closed = True
            incoming, self._incoming = self._incoming, []
            resets, self._resets = self._resets, []
        return incoming, resets

    def waiting(self) -> list[Sequence]:
        """The sequences handed over and not yet taken."""
        with self._wake:
            return list(self._incoming)

    def __len__(self) -> int:
        return len(self._incoming)

    def wait_for_work(self, holding: bool, queued: bool, all_paused: bool) -> bool:
        """(Engine thread.) Block until there is something to do; False when the engine is stopping.
        ``holding``: sequences are in the batch; ``queued``: some wait in the scheduler's queue;
        ``all_paused``: every running sequence waits for its client (neither changes meanwhile:
        only the engine thread changes them)."""
        with self._wake:
            news = self._incoming or self._cancelled or self._resets
            if not news and not holding and queued:
                self._wake.wait(0.05)  # requests wait but none fits: wait for a change rather than spin
            elif not news and all_paused:
                self._wake.wait(0.01)  # every sequence waits for its client to read
            while not self.stopping and not (self._incoming or self._cancelled or self._resets or holding or queued):
                self._wake.wait()
            return not self.stopping
