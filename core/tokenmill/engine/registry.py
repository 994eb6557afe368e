"""The engine's own record of every sequence it has taken in and not yet ended.

The scheduler plugin keeps the waiting sequences and the batch keeps the running ones; when a
plugin raises half-way (``admit`` after taking sequences off its queue, ``requeue`` after one
was set aside), a sequence can end up in neither. After such a fault the engine asks this
registry for those orphans and ends them with an error, so no request waits forever.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenmill.engine.sequence import Sequence


class LiveSequences:
    """Sequences taken from the inbox that have not had their last event (written by the engine thread)."""

    def __init__(self) -> None:
        self._by_id: dict[int, Sequence] = {}

    def add(self, seq: Sequence) -> None:
        self._by_id[seq.id] = seq

    def forget_ended(self, seqs: Iterable[Sequence]) -> None:
        """Drop those of ``seqs`` that have ended or were cancelled (a preempted one stays)."""
        for seq in seqs:
            if seq.ended or seq.cancelled:
                self._by_id.pop(seq.id, None)

    def all(self) -> list[Sequence]:
        """Every live sequence (safe to call from another thread: a copy)."""
        return list(self._by_id.values())

    def __len__(self) -> int:
        return len(self._by_id)

    def orphans(self, holding: list[Sequence], waiting: list[Sequence] | None) -> list[Sequence] | None:
        """The live sequences neither in the batch (``holding``) nor ``waiting``; None when what waits is
        unknown (the scheduler's queue could not say)."""
        self.forget_ended(self.all())
        if waiting is None:
            return None
        held = {id(seq) for seq in holding} | {id(seq) for seq in waiting}
        return [seq for seq in self._by_id.values() if id(seq) not in held]
