"""The ``priority`` scheduler: urgent and short requests first, and no request waits forever.

Each waiting request has a weight, in units of tokens:

    class weight (``--priority-class-weights``, default high 4000, normal 2000, low 0)
    + ``--priority-aging`` (default 100) × seconds waited
    - ``--priority-cost`` (default 1) × (prompt tokens + ``max_new_tokens``)

Heaviest first, within the step's limits (the engine's admission); like
``fifo`` it never skips past the heaviest request that does not fit, so once a request
is the heaviest it is the next to start. Every waiting request ages at the same rate,
so waiting never reorders two requests already in the queue; it lifts old ones above
newcomers. A request that has waited ``(W_top - W_own + cost_own - cost_min) / aging``
seconds outranks every request that arrives after that (``W``: class weights; with the
defaults a low request of 1,256 tokens outranks new high ones after about 52 s).

Unlike ``fifo``, a request starts as soon as it fits (TGI's waiting-served rule would
make a short or urgent request wait for company). When the heaviest waiting request
lacks a seat (``--max-batch-size``) or KV memory and a running sequence of a lower class
holds one, the lightest such sequence is preempted and requeued with its original
arrival time, to resume later with the same output: for a seat it is only suspended
and keeps its KV memory (nothing is recomputed); for memory its blocks are freed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import tokenmill
from tokenmill.engine.queue import WaitingQueue
from tokenmill.engine.sequence import PRIORITY_CLASSES, Sequence
from tokenmill.interfaces import BatchLimits, Preemption, Scheduler, SchedulerQueue


class PriorityQueue(WaitingQueue):
    """Heaviest first; the engine starts them in that order while they fit. A requeued sequence keeps
    its arrival time, so its place follows from its weight."""

    def __init__(self, limits: BatchLimits, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(limits)
        self.clock = clock
        self.class_weight = dict(limits.priority_class_weights)
        self.rank = {name: len(PRIORITY_CLASSES) - i for i, name in enumerate(PRIORITY_CLASSES)}

    def weight(self, seq: Sequence, now: float) -> float:
        request = seq.request
        return (self.class_weight[request.priority] + self.limits.priority_aging * (now - seq.arrived_at)
                - self.limits.priority_cost * (seq.prompt_len + request.max_new_tokens))

    def ordered(self) -> list[Sequence]:
        """The waiting sequences, heaviest first (earliest arrival first among equals)."""
        now = self.clock()
        return sorted(self.waiting, key=lambda s: (-self.weight(s, now), s.arrived_at, s.id))

    def choose_victim(self, running: list[Sequence], waiting: Sequence, shortage: str | None) -> Preemption | None:
        """The lightest running sequence of a lower class than ``waiting`` (the heaviest waiting one), when
        that one lacks a seat (it is suspended, keeping its KV memory) or KV memory (its memory is
        freed); never when it only waits for this step's prefill budget."""
        if shortage not in ("seats", "memory"):
            return None
        lower = [s for s in running if self.rank[s.request.priority] < self.rank[waiting.request.priority]]
        if not lower:
            return None
        now = self.clock()
        victim = min(lower, key=lambda s: (self.weight(s, now), -s.arrived_at))
        return Preemption(victim, keep_kv=shortage == "seats")


class PriorityScheduler(Scheduler):
    name = "priority"
    description = "heaviest first: class weight + aging - expected cost; preempts a lower class for a higher one"

    def create(self, limits: BatchLimits) -> SchedulerQueue:
        return PriorityQueue(limits)


@tokenmill.hookimpl
def tokenmill_schedulers() -> list[Scheduler]:
    return [PriorityScheduler()]
