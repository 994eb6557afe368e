"""The KV cache's one owner: :class:`KVCacheManager` allocates a block pool's blocks to sequences and keeps
the prefix cache. Per step, the scheduler calls :meth:`~KVCacheManager.lookup` and :meth:`~KVCacheManager.allocate`
while it plans, :meth:`~KVCacheManager.commit` once the forward succeeded (only then can others find the blocks
it filled), :meth:`~KVCacheManager.rollback` for drafts, and :meth:`~KVCacheManager.free`; a runner with KV
memory of its own answers the same calls through :class:`tokenmill.engine.runner_kv.RunnerKV`."""

from __future__ import annotations

from tokenmill.engine.prefix import block_hash, cacheable_blocks, full_block_hashes
from tokenmill.engine.sequence import Sequence
from tokenmill.interfaces import NO_HIT, BlockPool, PrefixHit, blocks_for

__all__ = ["KVCacheManager", "block_hash", "cacheable_blocks", "full_block_hashes"]  # hooks.md names them here


class KVCacheManager:
    """The blocks of a :class:`BlockPool`: who holds which, and (with prefix caching) their names."""

    def __init__(self, pool: BlockPool, prefix_caching: bool) -> None:
        self.pool = pool
        self.prefix_caching = prefix_caching
        """Set where the runner enabled it (its pool is a :class:`CachingBlockPool`)."""
        self.block_size = pool.block_size
        self._named: dict[int, int] = {}
        """Per sequence holding blocks (prefix caching): how many of its leading blocks have their names given."""
        self._unnamed: dict[int, list[tuple[int, bytes]]] = {}
        """Per sequence: the blocks its coming forward fills, and their names, given at :meth:`commit`."""
        self._planned: dict[bytes, int] = {}
        """Those blocks by name: a sequence planned later in the same step shares them."""
        self._drafted: dict[int, tuple[int, tuple[int, ...]]] = {}
        """Per sequence that feeds a draft this step: the position of its first token, and the draft."""

    # ---- what the scheduler asks ---------------------------------------------------------------

    def free_tokens(self) -> int:
        return self.pool.free_blocks() * self.block_size

    def usage(self) -> dict[str, int]:
        used = self.pool.num_blocks - self.pool.free_blocks()
        usage = {"bytes": used * self.pool.bytes_per_block(), "blocks_used": used, "blocks_total": self.pool.num_blocks}
        if self.prefix_caching:
            usage["blocks_cached"] = self.pool.cached_blocks()  # type: ignore[attr-defined]
        return usage

    def can_decode(self, seqs: list[Sequence]) -> bool:
        return sum(self._blocks_short(s, s.total_len) for s in seqs) <= self.pool.free_blocks()

    def lookup(self, seq: Sequence, planned: frozenset[bytes] = frozenset()) -> PrefixHit:
        """The cached prefix ``seq`` (holding no blocks) would take now: named blocks, then blocks that
        sequences planned earlier in this step fill (or that ``planned`` names, as admission counts them)."""
        if not self.prefix_caching or seq.num_computed or seq.wants_prompt_logits:
            return NO_HIT
        hashes = full_block_hashes(seq, self.block_size, cacheable_blocks(seq.total_len, self.block_size))
        blocks = self._find(hashes)
        count = len(blocks)
        while count < len(hashes) and hashes[count] in planned:
            count += 1
        return PrefixHit(count * self.block_size, self.pool.idle_among(blocks))  # type: ignore[attr-defined]

    prefix_hit = lookup
    """:class:`tokenmill.interfaces.PrefixLookup`'s name, which schedulers of hooks 1.x call."""

    def _find(self, hashes: list[bytes]) -> list[int]:
        blocks = self.pool.lookup(hashes)  # type: ignore[attr-defined]
        while len(blocks) < len(hashes) and hashes[len(blocks)] in self._planned:
            blocks.append(self._planned[hashes[len(blocks)]])
        return blocks

    def _blocks_short(self, seq: Sequence, tokens: int) -> int:
        return max(0, blocks_for(tokens, self.block_size) - len(self.pool.blocks_of(seq.id)))

    # ---- planning a step -----------------------------------------------------------------------

    def allocate(self, seq: Sequence, cached: int, chunk: int) -> None:
        """Before a step in which ``seq`` prefills ``chunk`` tokens: a sequence holding no blocks first
        takes the ``cached`` tokens :meth:`lookup` found (its progress starts there); then its whole
        context is reserved, and the blocks full after the chunk are named for :meth:`commit`.
        MemoryError when the pool is short, with nothing taken."""
        fresh = not self.pool.blocks_of(seq.id)
        if fresh and self.prefix_caching:
            self._take_cached(seq, cached)
        if not self.pool.reserve(seq.id, seq.total_len):
            if fresh:
                self.free([seq])
            raise MemoryError(f"the KV pool has no room for sequence {seq.id} ({seq.total_len} tokens)")
        self._name_filled(seq, seq.num_computed + chunk)

    def _take_cached(self, seq: Sequence, cached: int) -> None:
        hashes = full_block_hashes(seq, self.block_size, cached // self.block_size)
        blocks = self._find(hashes)
        if len(blocks) < len(hashes):
            raise RuntimeError(f"sequence {seq.id}: {len(hashes) - len(blocks)} of its cached blocks are gone")
        new_blocks = blocks_for(seq.total_len, self.block_size) - len(blocks)
        if new_blocks + self.pool.idle_among(blocks) > self.pool.free_blocks():  # type: ignore[attr-defined]
            raise MemoryError(f"the KV pool has no room for sequence {seq.id} ({seq.total_len} tokens)")
        if blocks:
            self.pool.share(seq.id, blocks)  # type: ignore[attr-defined]
        self._named[seq.id] = len(blocks)
        seq.num_computed = len(blocks) * self.block_size

    def allocate_decode(self, seqs: list[Sequence], drafts: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """Before a step in which ``seqs`` decode (each after its ``drafts``, if any): room for each one's
        newest token, and for its draft where the pool holds it; returns the drafts they feed."""
        fed: list[tuple[int, ...]] = []
        for seq, draft in zip(seqs, drafts or [()] * len(seqs)):
            if not self.pool.reserve(seq.id, seq.total_len):
                raise MemoryError(f"the KV pool has no room for sequence {seq.id}'s next token")
            if draft and not self.pool.reserve(seq.id, seq.total_len + len(draft)):
                draft = ()
            if draft:
                self._drafted[seq.id] = (seq.total_len, tuple(draft))
            self._name_filled(seq, seq.total_len)
            fed.append(tuple(draft))
        return fed

    def _name_filled(self, seq: Sequence, computed: int) -> None:
        """Give the names of the blocks that are full once ``seq``'s first ``computed`` tokens are in the
        cache, to be committed after the forward."""
        named, full = self._named.get(seq.id), computed // self.block_size
        if named is None or named >= full:
            return
        table, hashes = self.pool.blocks_of(seq.id), full_block_hashes(seq, self.block_size, full)
        for index in range(named, full):
            self._unnamed.setdefault(seq.id, []).append((table[index], hashes[index]))
            self._planned.setdefault(hashes[index], table[index])
        self._named[seq.id] = full

    # ---- after the step --------------------------------------------------------------------------

    def commit(self, seqs: list[Sequence] | tuple[Sequence, ...]) -> None:
        """The forward that ``seqs`` ran in succeeded: the blocks it filled bear their names now."""
        for seq in seqs:
            for block, name in self._unnamed.pop(seq.id, ()):
                self.pool.name(block, name)  # type: ignore[attr-defined]
                if self._planned.get(name) == block:
                    del self._planned[name]

    def drop_drafts(self, seqs: list[Sequence] | tuple[Sequence, ...]) -> None:
        """After a failed step: forget its drafts, and the memory they took."""
        for seq in seqs:
            if self._drafted.pop(seq.id, None) is not None:
                self._truncate(seq)

    def rollback(self, seq: Sequence) -> None:
        """After a step with a draft, once ``seq`` kept its tokens: name the blocks its accepted draft
        tokens filled, and drop the KV of the rejected ones (it holds positions below ``num_computed``)."""
        start, draft = self._drafted.pop(seq.id, (0, ()))
        if not draft or seq.num_computed < start:  # none, or it got no token (cancelled, failed): it ends now
            return
        self._name_filled(seq, seq.num_computed)
        self.commit([seq])
        self._truncate(seq)

    def _truncate(self, seq: Sequence) -> None:
        truncate = getattr(self.pool, "truncate", None)
        if truncate is not None:
            truncate(seq.id, seq.num_computed)

    def free(self, seqs: list[Sequence]) -> None:
        """``seqs`` let go of their blocks (named ones stay cached): each holds nothing, so has computed nothing."""
        for seq in seqs:
            self.pool.free(seq.id)
            self._named.pop(seq.id, None)
            self._drafted.pop(seq.id, None)
            for block, name in self._unnamed.pop(seq.id, ()):
                if self._planned.get(name) == block:
                    del self._planned[name]
            seq.num_computed = 0

    def reset(self, seqs: list[Sequence]) -> None:
        """Forget every block, cached ones too (after a step failed half-way none can be trusted); each of
        ``seqs`` (every live sequence) then holds nothing."""
        self.pool.free_all()
        if self.prefix_caching:
            self.pool.drop_cached()  # type: ignore[attr-defined]
        self._named.clear()
        self._unnamed.clear()
        self._planned.clear()
        self._drafted.clear()
        for seq in seqs:
            seq.num_computed = 0

    def drop_cached(self) -> int:
        """Free every cached block that no sequence holds; how many (``POST /reset_prefix_cache``)."""
        return self.pool.drop_cached() if self.prefix_caching else 0  # type: ignore[attr-defined]
