"""Names of KV blocks for automatic prefix caching, as hooks.md promised plugins: the functions live with
the KV-cache manager (:mod:`tokenmill.engine.kv_cache`), which names blocks for the paged runner now;
:class:`BlockChain` stays here for a runner of its own that names its blocks as it fills them."""

from __future__ import annotations

from tokenmill.engine.kv_cache import block_hash, cacheable_blocks, full_block_hashes

__all__ = ["BlockChain", "block_hash", "cacheable_blocks", "full_block_hashes"]


class BlockChain:
    """The names of the blocks one sequence has filled so far, and the tokens of the block it is filling."""

    def __init__(self, namespace: str, block_size: int, hashes: list[bytes]) -> None:
        self.namespace = namespace
        self.block_size = block_size
        self.parent = hashes[-1] if hashes else None
        self.blocks = len(hashes)
        self.tail: list[int] = []

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size + len(self.tail)

    def extend(self, tokens: list[int]) -> list[tuple[int, bytes]]:
        """Add the next ``tokens``; returns (block index, name) of each block they complete."""
        completed = []
        start = 0
        while start < len(tokens):
            room = self.block_size - len(self.tail)
            self.tail.extend(tokens[start:start + room])
            start += room
            if len(self.tail) == self.block_size:
                self.parent = block_hash(self.parent, self.tail, self.namespace)
                completed.append((self.blocks, self.parent))
                self.blocks += 1
                self.tail = []
        return completed
