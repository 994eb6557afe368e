"""What a scheduler may admit in one step: the batch limits, kept in one place for every scheduler.

A scheduler decides the order; :class:`Room` says whether the next sequence in that
order still fits this step, and :func:`joins_now` applies TGI's rule for when newcomers
may join a running batch at all.
"""

from __future__ import annotations

from tokenmill.engine.prefix import full_block_hashes
from tokenmill.engine.sequence import Sequence
from tokenmill.interfaces import NO_HIT, BatchLimits, PrefixHit, StepBudget, blocks_for


class Room:
    """What is left of one step's limits while a scheduler picks sequences.

    - Prefill: a waiting sequence fits what is left of the step's prefill budget (for a
      padded backend a prefill of n prompts costs n × the longest; a backend with chunked
      prefill may start a long prompt now and finish it over the next steps).
    - KV memory: with a block pool, the blocks of its whole context must be free now,
      keeping one block for each sequence that holds memory to grow into (none for a
      sequence alone); otherwise its whole lifetime (prompt + ``max_new_tokens``) must fit
      what the batch leaves of ``--max-batch-total-tokens``.
    - Batch size: at most ``--max-batch-size`` sequences hold memory at once.

    With a prefix cache, only the tokens it does not hold count against the prefill budget,
    and only the blocks it does not hold against KV memory (a cached block no sequence holds
    counts as free until it is taken). A sequence admitted in the same step counts as holding
    the full blocks it will compute, since the next one shares them.
    """

    def __init__(self, limits: BatchLimits, holding: list[Sequence], budget: StepBudget) -> None:
        self.limits = limits
        self.budget = budget
        self.holding = len(holding)
        self.admitted = 0
        self.prefill_tokens = 0
        self.longest = 0
        self.seats = None if limits.max_batch_size is None else limits.max_batch_size - len(holding)
        self.planned: frozenset[bytes] = frozenset()
        """Names of the blocks the sequences admitted so far will compute this step."""
        self._hits: dict[int, PrefixHit] = {}
        if budget.kv_free_tokens is None:
            self.total_tokens_left = limits.max_batch_total_tokens - sum(s.max_tokens for s in holding)
        else:
            self.kv_blocks_left = budget.kv_free_tokens // budget.block_size - len(holding)

    def fits(self, seq: Sequence) -> bool:
        return self.shortage(seq) is None

    def shortage(self, seq: Sequence) -> str | None:
        """What ``seq`` lacks to start this step: ``"seats"`` (batch size), ``"prefill"``
        (this step's prefill budget) or ``"memory"`` (KV); None when it fits."""
        if self.seats is not None and self.admitted >= self.seats:
            return "seats"
        longest = max(self.longest, seq.pending_len)
        cost = (self.admitted + 1) * longest if self.limits.padded else self.prefill_tokens + self._uncached(seq)
        prefill = self.budget.prefill_tokens
        if cost > prefill and not (self.budget.chunked and self.prefill_tokens < prefill):
            return "prefill"
        if self.budget.kv_free_tokens is None:
            return None if seq.max_tokens <= self.total_tokens_left else "memory"
        return None if self._blocks_needed(seq) <= self.kv_blocks_left else "memory"

    def take(self, seq: Sequence) -> None:
        """Count ``seq`` as admitted this step (after :meth:`fits` said yes)."""
        if self.budget.kv_free_tokens is None:
            self.total_tokens_left -= seq.max_tokens
        else:
            self.kv_blocks_left -= self._blocks_needed(seq)
        prefix = self.budget.prefix
        if prefix is not None:
            chunk = min(self._uncached(seq), max(0, self.budget.prefill_tokens - self.prefill_tokens))
            computed = seq.num_computed + self._hit(seq).tokens + chunk
            self.planned |= frozenset(
                full_block_hashes(seq, self.budget.block_size, computed // self.budget.block_size))
        self.admitted += 1
        self.longest = max(self.longest, seq.pending_len)
        self.prefill_tokens += self._uncached(seq)

    def _hit(self, seq: Sequence) -> PrefixHit:
        """What ``seq`` would take from the prefix cache (looked up once per step)."""
        prefix = self.budget.prefix
        if prefix is None:
            return NO_HIT
        hit = self._hits.get(seq.id)
        if hit is None:
            hit = self._hits[seq.id] = prefix.prefix_hit(seq, self.planned)
        return hit

    def _uncached(self, seq: Sequence) -> int:
        """Its tokens still to prefill that the prefix cache does not hold."""
        return seq.pending_len - self._hit(seq).tokens

    def _blocks_needed(self, seq: Sequence) -> int:
        """New blocks: its whole context, less what it still holds (a suspended sequence keeps
        its blocks) or shares from the cache, plus one to grow into unless it is alone."""
        alone = not self.holding and not self.admitted
        block_size = self.budget.block_size
        hit = self._hit(seq)
        held = blocks_for(seq.num_computed, block_size) + hit.tokens // block_size - hit.idle_blocks
        return blocks_for(seq.total_len, block_size) - held + (0 if alone else 1)


def joins_now(admitting: int, batch_size: int, steps_waited: int, limits: BatchLimits) -> bool:
    """TGI's rule for a running batch: ``admitting`` newcomers join it now when they are at
    least ``waiting_served_ratio`` × its size, or when ``max_waiting_tokens`` decode steps
    have passed since newcomers last joined. Joining costs the running sequences a prefill
    step; waiting for a group of them pays that cost once for several."""
    if admitting == 0:
        return False
    if batch_size == 0 or steps_waited >= limits.max_waiting_tokens:
        return True
    return admitting >= int(batch_size * limits.waiting_served_ratio)
