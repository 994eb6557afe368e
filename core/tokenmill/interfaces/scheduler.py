"""The scheduler kind: the limits it admits within and the waiting queue it builds."""

from __future__ import annotations

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
    """The waiting queue of one engine. Called from the engine thread only (``__len__`` from anywhere)."""

    def add(self, seq: Sequence) -> None: ...
    def requeue(self, seq: Sequence) -> None:
        """Put a preempted sequence back, ahead of those that never ran."""
        ...

    def remove(self, seq: Sequence) -> bool: ...
    def __len__(self) -> int: ...
    def admit(self, holding: list[Sequence], budget: StepBudget) -> list[Sequence]:
        """The waiting sequences to start prefilling now, removed from the queue.
        ``holding`` are the sequences that already hold KV memory."""
        ...

    def drain(self) -> list[Sequence]:
        """Remove and return every waiting sequence (at shutdown)."""
        ...

    def pending(self) -> list[Sequence]:
        """The waiting sequences in the order they would start (for ``GET /queue``); the queue is not changed."""
        ...

    # Optional: a queue may also define
    #     preempt(self, running: list[Sequence], budget: StepBudget) -> list[Preemption]
    # which the engine calls before ``admit`` each step: the running sequences to set
    # aside now so that waiting ones can start. They are requeued and resume later with
    # the same output.


@dataclass(frozen=True)
class Preemption:
    """A running sequence a scheduler sets aside for waiting ones."""

    seq: Sequence
    keep_kv: bool
    """True: it only gives up its place in the batch and keeps its KV memory, and resumes without
    recomputing (where the backend can leave rows out of a step; otherwise it is treated as
    False). False: its KV memory is freed and its tokens are recomputed when it resumes."""


class Scheduler(Implementation):
    """Decides which waiting requests join the running batch."""

    kind = "scheduler"

    def create(self, limits: BatchLimits) -> SchedulerQueue:
        raise NotImplementedError
