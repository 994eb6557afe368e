"""Names of KV blocks for automatic prefix caching, as hooks.md promised plugins: what the KV-cache manager
(:mod:`tokenmill.engine.kv_cache`) names the paged runner's blocks with, and :class:`BlockChain` for a runner
of its own that names its blocks as it fills them."""

from __future__ import annotations

import hashlib
from array import array

from tokenmill.engine.sequence import Sequence

__all__ = ["BlockChain", "block_hash", "cacheable_blocks", "full_block_hashes"]


def block_hash(parent: bytes | None, tokens: list[int], namespace: str = "", images: bytes = b"") -> bytes:
    """The name of a block holding ``tokens`` after the block named ``parent`` (None: the first block).

    A full block's keys and values depend on its tokens, on every token before it, and on what else changes
    the model's work: the LoRA adapter and a tenant's ``cache_salt`` (its *namespace*). So two prompts share
    a block exactly when they share everything up to its end, and tenants with different salts never share
    one. BLAKE2b (128 bits): no client can craft a prompt whose blocks collide with another's. ``images``: the
    digests of the images whose first token is in the block (``ImagePrompt.block_digest``)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent if parent is not None else b"tokenmill-prefix\0" + namespace.encode() + b"\0")
    digest.update(array("q", tokens).tobytes())
    if images:
        digest.update(b"\0images\0" + images)
    return digest.digest()


def full_block_hashes(seq: Sequence, block_size: int, count: int) -> list[bytes]:
    """The names of ``seq``'s first ``count`` blocks (each full), kept on ``seq.block_hashes`` so each is
    hashed once: a waiting sequence is looked up at every step until it starts."""
    memo, tokens, images = seq.block_hashes, seq.token_ids, seq.images
    assert len(tokens) >= count * block_size, "only full blocks have names"
    for index in range(len(memo), count):
        block = tokens[index * block_size:(index + 1) * block_size]
        pixels = images.block_digest(index, block_size) if images is not None else b""
        memo.append(block_hash(memo[-1] if memo else None, block, seq.cache_namespace, pixels))
    return memo[:count]


def cacheable_blocks(total_len: int, block_size: int) -> int:
    """Leading blocks of a context of ``total_len`` tokens that a new sequence may take from the cache:
    whole blocks, leaving at least the last token to compute (its logits give the next token)."""
    return (total_len - 1) // block_size


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
