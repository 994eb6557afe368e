"""The ``fifo`` scheduler: first come, first served, within TGI's batch limits.

A waiting request starts when its prompt fits what is left of this step's prefill
budget (``--max-batch-prefill-tokens``; for a padded backend a prefill of n
prompts costs n × the longest; a backend with chunked prefill starts a long
prompt now and finishes it over the next steps) and its KV memory fits: with a
block pool, the blocks of its prompt must be free now, keeping one block for
each sequence that holds memory to grow into (none for a sequence alone);
otherwise its whole lifetime (prompt +
``max_new_tokens``) must fit what the batch leaves of ``--max-batch-total-tokens``.
Preempted sequences go back to the head of the line. The queue never skips
ahead: the head of the line waits for room rather than be overtaken.
"""

from __future__ import annotations

from collections import deque

import tokenmill
from tokenmill.interfaces import BatchLimits, Scheduler, SchedulerQueue, StepBudget
from tokenmill.sequence import Sequence


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class FifoQueue(SchedulerQueue):
    def __init__(self, limits: BatchLimits) -> None:
        self.limits = limits
        self.waiting: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def requeue(self, seq: Sequence) -> None:
        self.waiting.appendleft(seq)

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

    def admit(self, holding: list[Sequence], budget: StepBudget) -> list[Sequence]:
        limits = self.limits
        room = None if limits.max_batch_size is None else limits.max_batch_size - len(holding)
        if budget.kv_free_tokens is None:
            total_left = limits.max_batch_total_tokens - sum(s.max_tokens for s in holding)
        else:
            kv_blocks_left = budget.kv_free_tokens // budget.block_size - len(holding)
        admitted: list[Sequence] = []
        prefill_tokens = longest = 0
        while self.waiting:
            seq = self.waiting[0]
            if room is not None and len(admitted) >= room:
                break
            longest = max(longest, seq.pending_len)
            cost = (len(admitted) + 1) * longest if limits.padded else prefill_tokens + seq.pending_len
            if cost > budget.prefill_tokens and not (budget.chunked and prefill_tokens < budget.prefill_tokens):
                break
            if budget.kv_free_tokens is None:
                if seq.max_tokens > total_left:
                    break
                total_left -= seq.max_tokens
            else:
                alone = not holding and not admitted
                needed = blocks_for(seq.total_len, budget.block_size) + (0 if alone else 1)
                if needed > kv_blocks_left:
                    break
                kv_blocks_left -= needed
            self.waiting.popleft()
            admitted.append(seq)
            prefill_tokens += seq.pending_len
        return admitted


class FifoScheduler(Scheduler):
    name = "fifo"
    description = "first come, first served within the prefill, KV-memory and batch-size limits"

    def create(self, limits: BatchLimits) -> SchedulerQueue:
        return FifoQueue(limits)


@tokenmill.hookimpl
def tokenmill_schedulers() -> list[Scheduler]:
    return [FifoScheduler()]
