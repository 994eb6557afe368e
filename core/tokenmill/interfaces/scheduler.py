"""The scheduler kind: the limits it admits within and the waiting queue it builds."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tokenmill.interfaces.base import Implementation

if TYPE_CHECKING:
    from tokenmill.engine.sequence import Sequence
    from tokenmill.interfaces.kv import PrefixLookup


@dataclass(frozen=True)
class BatchLimits:
    """The limits a scheduler admits within (TGI's names)."""

    max_batch_prefill_tokens: int
    max_batch_total_tokens: int
    max_batch_size: int | None
    padded: bool = False
    """True when the backend pads the batch to its longest prompt, so a prefill of n
    prompts costs n × the longest of them (TGI counts it the same way)."""
    waiting_served_ratio: float = 0.3
    """While a batch runs, newcomers join only when at least this × its size of them can."""
    max_waiting_tokens: int = 20
    """... or when this many decode steps have passed since the last admission."""
    priority_class_weights: tuple[tuple[str, float], ...] = (("high", 4000.0), ("normal", 2000.0), ("low", 0.0))
    """The ``priority`` scheduler's weight of each request class."""
    priority_aging: float = 100.0
    """... plus this much weight per second a request has waited ..."""
    priority_cost: float = 1.0
    """... minus this much per token of its expected cost (prompt + ``max_new_tokens``)."""


@dataclass(frozen=True)
class StepBudget:
    """What one engine step can still take in, as the engine sees it when it asks to admit."""

    prefill_tokens: int
    """Prompt tokens this step can still prefill."""
    chunked: bool
    """Whether a prompt longer than ``prefill_tokens`` may start now and go on in later steps."""
    kv_free_tokens: int | None
    """KV positions free now (paged); None when KV memory follows ``max_batch_total_tokens``."""
    block_size: int = 1
    prefix: PrefixLookup | None = None
    """Where the prompts' computed prefixes are looked up; None when the backend caches none."""


class SchedulerQueue(Protocol):
    """A scheduling policy (hooks 2.0): the waiting sequences of one engine, in the order they start.

    The engine does admission and memory (:class:`tokenmill.engine.admission.Admission`): each step
    it takes sequences with ``peek`` and ``pop`` while they fit the step's limits. Called from the
    engine thread only (``__len__`` from anywhere).
    """

    def add(self, seq: Sequence) -> None:
        """A new sequence waits."""
        ...

    def prepend(self, seq: Sequence) -> None:
        """A sequence that ran (preempted, suspended) or could not start after all waits again, ahead of
        those that never ran; it keeps its ``arrived_at``."""
        ...

    def peek(self) -> Sequence:
        """The sequence that starts next (the queue is not empty)."""
        ...

    def pop(self) -> Sequence:
        """Remove and return the sequence ``peek`` names."""
        ...

    def remove(self, seq: Sequence) -> bool:
        """Take a cancelled sequence out; False when it was not waiting."""
        ...

    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Sequence]:
        """The waiting sequences in the order they would start (``GET /queue``); the queue is not changed."""
        ...

    # Optional: a policy may also define
    #     waits_for_company: bool  (True: newcomers join a running batch only by TGI's rule, ``joins_now``)
    #     choose_victim(self, running: list[Sequence], waiting: Sequence, shortage: str | None) -> Preemption | None
    # which the engine calls before admitting, when sequences run and ``waiting`` (the next to start)
    # lacks ``shortage`` ("seats", "prefill" or "memory"; None: it fits): the running sequence to set
    # aside now, requeued to resume later with the same output.


@dataclass(frozen=True)
class Preemption:
    """A running sequence a scheduler sets aside for waiting ones."""

    seq: Sequence
    keep_kv: bool
    """True: it only gives up its place in the batch and keeps its KV memory, and resumes without
    recomputing (where the backend can leave rows out of a step; otherwise it is treated as
    False). False: its KV memory is freed and its tokens are recomputed when it resumes."""


class Scheduler(Implementation):
    """Decides the order in which waiting requests join the running batch."""

    kind = "scheduler"

    def create(self, limits: BatchLimits) -> SchedulerQueue:
        raise NotImplementedError
