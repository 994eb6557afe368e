"""The ``fifo`` scheduler: first come, first served, within TGI's batch limits.

A waiting request joins the running batch when its prompt fits the prefill budget
(``--max-batch-prefill-tokens``; for a padded backend a prefill of n prompts costs
n × the longest), its whole lifetime (prompt + ``max_new_tokens``)
fits what the running batch leaves of ``--max-batch-total-tokens``, and the batch
is below ``--max-batch-size``. The queue never skips ahead: the head of the line
waits for room rather than be overtaken.
"""

from __future__ import annotations

from collections import deque

import tokenmill
from tokenmill.interfaces import BatchLimits, Scheduler, SchedulerQueue
from tokenmill.sequence import Sequence


class FifoQueue(SchedulerQueue):
    def __init__(self, limits: BatchLimits) -> None:
        self.limits = limits
        self.waiting: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> bool:
        try:
            self.waiting.remove(seq)
            return True
        except ValueError:
            return False

    def __len__(self) -> int:
        return len(self.waiting)

    def drain(self) -> list[Sequence]:
        drained = list(self.waiting)
        self.waiting.clear()
        return drained

    def admit(self, running: list[Sequence]) -> list[Sequence]:
        limits = self.limits
        total_budget = limits.max_batch_total_tokens - sum(s.max_tokens for s in running)
        prefill_budget = limits.max_batch_prefill_tokens
        room = None if limits.max_batch_size is None else limits.max_batch_size - len(running)
        admitted: list[Sequence] = []
        prefill_tokens = longest = 0
        while self.waiting:
            seq = self.waiting[0]
            if room is not None and len(admitted) >= room:
                break
            longest = max(longest, seq.prompt_len)
            cost = (len(admitted) + 1) * longest if limits.padded else prefill_tokens + seq.prompt_len
            if cost > prefill_budget or seq.max_tokens > total_budget:
                break
            self.waiting.popleft()
            admitted.append(seq)
            prefill_tokens += seq.prompt_len
            total_budget -= seq.max_tokens
        return admitted


class FifoScheduler(Scheduler):
    name = "fifo"
    description = "first come, first served within the prefill, total-token and batch-size limits"

    def create(self, limits: BatchLimits) -> SchedulerQueue:
        return FifoQueue(limits)


@tokenmill.hookimpl
def tokenmill_schedulers() -> list[Scheduler]:
    return [FifoScheduler()]
