"""The KV-cache manager's calls for a runner that keeps its own KV memory: the padded transformers
backend, or a third-party runner without a ``kv_pool`` (hooks 1.x's ``prefix_hit``, ``plan_prefill``,
``rollback``, ``release``, ...)."""

from __future__ import annotations

from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.sequence import Sequence
from tokenmill.interfaces import NO_HIT, BackendRunner, PrefixHit


class RunnerKV:
    """The same calls for a runner that keeps its own KV memory (no ``kv_pool``): each goes to the
    runner's method of hooks 1.x (``prefix_hit``, ``plan_prefill``, ``rollback``, ``release``, ...)."""

    def __init__(self, runner: BackendRunner) -> None:
        self.runner = runner
        self.prefix_caching = bool(getattr(runner, "prefix_caching", False))
        self.block_size = runner.kv_block_size

    def free_tokens(self) -> int | None:
        return self.runner.kv_free_tokens()

    def usage(self) -> dict[str, int]:
        return self.runner.kv_usage()

    def can_decode(self, seqs: list[Sequence]) -> bool:
        return self.runner.can_decode(seqs)

    def lookup(self, seq: Sequence, planned: frozenset[bytes] = frozenset()) -> PrefixHit:
        return self.runner.prefix_hit(seq, planned) if self.prefix_caching and not seq.num_computed else NO_HIT

    prefix_hit = lookup

    def allocate(self, seq: Sequence, cached: int, chunk: int) -> None:
        if not self.prefix_caching:
            return
        fresh = not seq.num_computed
        if fresh:
            seq.num_computed = cached
        try:
            self.runner.plan_prefill(seq, chunk)
        except BaseException:
            if fresh:
                seq.num_computed = 0
            raise

    def allocate_decode(self, seqs: list[Sequence], drafts: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        return list(drafts)  # the runner feeds what its memory holds

    def commit(self, seqs: list[Sequence] | tuple[Sequence, ...]) -> None:
        """The runner named its blocks in its step."""

    def drop_drafts(self, seqs: list[Sequence] | tuple[Sequence, ...]) -> None:
        """The runner dropped them when its step failed."""

    def rollback(self, seq: Sequence) -> None:
        self.runner.rollback([seq])

    def free(self, seqs: list[Sequence]) -> None:
        self.runner.release(seqs)
        for seq in seqs:
            seq.num_computed = 0

    def reset(self, seqs: list[Sequence]) -> None:
        self.runner.reset()
        for seq in seqs:
            seq.num_computed = 0

    def drop_cached(self) -> int:
        return self.runner.reset_prefix_cache() if self.prefix_caching else 0


def kv_cache_for(runner: BackendRunner) -> KVCacheManager | RunnerKV:
    """The manager of a runner's KV memory: the engine's own over its ``kv_pool``, else the runner's."""
    pool = getattr(runner, "kv_pool", None)
    if pool is None:
        return RunnerKV(runner)
    return KVCacheManager(pool, bool(getattr(runner, "prefix_caching", False)))
