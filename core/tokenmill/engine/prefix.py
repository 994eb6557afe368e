"""Names of KV blocks for automatic prefix caching: a hash chain over a sequence's full blocks.

A full block's keys and values depend on its tokens, on every token before it, and on what
else changes the model's work: the LoRA adapter and a tenant's ``cache_salt`` (its
*namespace*). So block ``i`` is named ``H(name of block i-1, tokens of block i)``, and the
first block's name folds in the namespace: two prompts share a block exactly when they share
everything up to its end, and tenants with different salts never share one. The hash is
BLAKE2b (128 bits), so no client can craft a prompt that collides with another's blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Protocol


class Chained(Protocol):
    """What naming a sequence's blocks reads: its tokens, its namespace, and a memo of the names."""

    token_ids: list[int]
    cache_namespace: str
    block_hashes: list[bytes]


def block_hash(parent: bytes | None, tokens: list[int], namespace: str = "") -> bytes:
    """The name of a block holding ``tokens`` after the block named ``parent`` (None: the first block)."""
    digest = hashlib.blake2b(digest_size=16)
    if parent is None:
        digest.update(b"tokenmill-prefix\0" + namespace.encode() + b"\0")
    else:
        digest.update(parent)
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


def full_block_hashes(seq: Chained, block_size: int, count: int) -> list[bytes]:
    """The names of ``seq``'s first ``count`` blocks (each full), kept on ``seq.block_hashes`` so each is
    hashed once: a waiting sequence is looked up at every step until it starts."""
    memo = seq.block_hashes
    if len(memo) < count:
        tokens = seq.token_ids
        assert len(tokens) >= count * block_size, "only full blocks have names"
        for index in range(len(memo), count):
            memo.append(block_hash(memo[-1] if memo else None, tokens[index * block_size:(index + 1) * block_size],
                                   seq.cache_namespace))
    return memo[:count]


def cacheable_blocks(total_len: int, block_size: int) -> int:
    """Leading blocks of a context of ``total_len`` tokens that a new sequence may take from the cache:
    whole blocks, leaving at least the last token to compute (its logits give the next token)."""
    return (total_len - 1) // block_size


class BlockChain:
    """The names of the blocks one sequence has filled so far, and the tokens of the block it is filling:
    what a runner extends as the sequence's tokens are computed, naming each block as it fills."""

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
