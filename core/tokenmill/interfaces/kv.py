"""The KV-allocator kind: the stores of the KV cache (padded and paged), and cached-prefix lookups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from tokenmill.interfaces.base import Implementation

if TYPE_CHECKING:
    import torch

    from tokenmill.engine.sequence import Sequence


def blocks_for(tokens: int, block_size: int) -> int:
    """How many blocks of ``block_size`` positions hold ``tokens`` positions (whole blocks, rounded up)."""
    return -(-tokens // block_size)


@runtime_checkable
class PaddedKVCache(Protocol):
    """KV storage for a left-padded batch: rows are sequences, columns are positions."""

    def new_cache(self, model_config: Any) -> Any: ...
    def concat(self, first: Any, second: Any, first_len: int, second_len: int) -> Any: ...
    def select_rows(self, cache: Any, rows: torch.Tensor) -> Any: ...
    def trim_left(self, cache: Any, columns: int) -> Any: ...
    def nbytes(self, cache: Any) -> int: ...


@runtime_checkable
class BlockPool(Protocol):
    """KV storage in fixed-size blocks shared by all sequences (the paged layout).

    A pool may also offer ``truncate(seq_id, tokens)``: keep only the sequence's first ``tokens``
    positions, zeroing the rest of the block that holds the last of them and freeing the blocks after
    it. The paged runner calls it to drop rejected drafts (``--speculate``); without it they stay
    until overwritten, never read (a sequence's context length masks them).

    It may also offer ``release_memory() -> int``: while no sequence holds a block, forget every cached
    block and give the blocks' memory back to the operating system (bytes returned). The paged runner
    calls it when the server sleeps (``--sleep-after-idle``, ``POST /sleep``)."""

    block_size: int
    num_blocks: int

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value blocks of one layer, each ``[blocks, block_size, kv_heads, dim]``."""
        ...

    def free_blocks(self) -> int: ...
    def blocks_of(self, seq_id: int) -> list[int]: ...
    def reserve(self, seq_id: int, tokens: int) -> bool:
        """Make the sequence's blocks hold ``tokens`` positions; False (nothing taken) when the pool is short."""
        ...

    def free(self, seq_id: int) -> None:
        """Return the sequence's blocks to the free list (shared ones when their last user lets go)."""
        ...

    def free_all(self) -> None: ...
    def bytes_per_block(self) -> int: ...


@runtime_checkable
class CachingBlockPool(BlockPool, Protocol):
    """A block pool that keeps computed blocks for reuse (automatic prefix caching).

    A full block may be *named* by the hash of its contents (see :mod:`tokenmill.engine.kv_cache`). A named
    block whose last holder lets go stays in the pool as *cached*, unreferenced, in least recently
    used order, instead of returning to the free list; ``free_blocks()`` counts it as free, and
    ``reserve`` evicts the least recently used cached block once the free list is empty."""

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The blocks named by the leading ``hashes``, up to the first that no block bears (the pool is not changed)."""
        ...

    def idle_among(self, blocks: list[int]) -> int:
        """How many of ``blocks`` no sequence holds now (cached, counted as free)."""
        ...

    def share(self, seq_id: int, blocks: list[int]) -> None:
        """Start the (empty) table of ``seq_id`` with ``blocks``, each held once more."""
        ...

    def name(self, block: int, block_hash: bytes) -> bool:
        """Name a full, computed block; False (nothing done) when another block bears that hash already."""
        ...

    def unname(self, block: int) -> None:
        """Forget a block's name (its contents were never computed); an unheld one returns to the free list."""
        ...

    def drop_cached(self) -> int:
        """Free every cached block no sequence holds; returns how many."""
        ...

    def cached_blocks(self) -> int:
        """Blocks that bear a name, held or not."""
        ...


class KVAllocator(Implementation):
    """Owns the memory of the KV cache; ``create`` returns the backend-facing store."""

    kind = "kv_allocator"
    layout: str = "padded"
    """The layout this allocator serves: ``padded`` (transformers backend) or ``paged``."""

    def create(self, model_config: Any, dtype: torch.dtype, device: torch.device, max_tokens: int,
               block_size: int) -> PaddedKVCache | BlockPool:
        """The store for one model; a paged pool holds ``max_tokens`` positions in ``block_size`` blocks."""
        raise NotImplementedError


@dataclass(frozen=True)
class PrefixHit:
    """The leading tokens of a sequence whose keys and values the KV pool holds already."""

    tokens: int
    """Tokens that need no prefill (whole blocks; never the last token, whose logits are needed)."""
    idle_blocks: int = 0
    """Of the blocks it would take, those no sequence holds now: taking them uses up free KV memory."""

NO_HIT = PrefixHit(0)


class PrefixLookup(Protocol):
    """Answers, without changing anything, how much of a waiting sequence's context is cached."""

    def prefix_hit(self, seq: Sequence, planned: frozenset[bytes] = frozenset()) -> PrefixHit:
        """The cached prefix ``seq`` would take if it started now; ``planned`` names blocks that sequences
        admitted earlier in the same step will compute, which it would share too."""
        ...


def padded_block_tables(pool: BlockPool, seq_ids: list[int]) -> torch.Tensor:
    """``[sequences, most blocks]`` int32: each sequence's blocks in ``pool``, padded with 0 (the zero
    block), as paged attention kernels read them."""
    import torch  # the contracts themselves need no torch at import
    tables = [pool.blocks_of(seq_id) for seq_id in seq_ids]
    block_tables = torch.zeros((len(tables), max(len(t) for t in tables)), dtype=torch.int32)
    for row, table in enumerate(tables):
        block_tables[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
    return block_tables
