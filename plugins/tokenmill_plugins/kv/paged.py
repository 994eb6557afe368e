"""The ``paged`` KV allocator: one pool of fixed-size blocks per layer, shared by all sequences.

A sequence owns a block table (its blocks in order); blocks come off a free list as it
grows. Each block has a reference count, so that several sequences can hold one block (a
shared prompt prefix). When its last holder lets go, a block returns to the free list, or,
if it bears a name (prefix caching: the hash of its contents), stays *cached*: unreferenced,
in least recently used order, ready for the next sequence whose prompt begins the same way.
Cached blocks count as free; once the free list is empty, the least recently used one is
evicted. Block 0 is never handed out: it stays zeroed, so padded reads in a kernel see
zeros, not garbage.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any

import torch

import tokenmill
from tokenmill.interfaces import BlockPool, CachingBlockPool, KVAllocator, blocks_for
from tokenmill.model.kv_memory import model_kv_shape, release_pages


class PagedPool(CachingBlockPool):
    def __init__(self, layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks + 1, block_size, kv_heads, head_dim)  # + the zero block
        # Uninitialised: on CPU the pages are only touched as blocks are handed out, so an unused
        # pool costs no RAM. Each block is zeroed when handed out (see reserve).
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
        self._zero([0])
        self.free_list: deque[int] = deque(range(1, num_blocks + 1))
        """Blocks no sequence holds and no name keeps, taken from the front; a freed block goes back to the
        front, so that its pages, already in memory, are written next and the pool's untouched pages stay
        untouched: the RSS grows with the most blocks held (or cached) at once, not with the traffic."""
        self.cached: OrderedDict[int, None] = OrderedDict()
        """Named blocks no sequence holds, least recently used first."""
        self.ref_counts = [0] * (num_blocks + 1)
        self.tables: dict[int, list[int]] = {}
        self.by_hash: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[index], self.values[index]

    def free_blocks(self) -> int:
        return len(self.free_list) + len(self.cached)

    def blocks_of(self, seq_id: int) -> list[int]:
        return self.tables.get(seq_id, [])

    def reserve(self, seq_id: int, tokens: int) -> bool:
        table = self.tables.setdefault(seq_id, [])
        missing = blocks_for(tokens, self.block_size) - len(table)
        if missing > self.free_blocks():
            if not table:
                del self.tables[seq_id]
            return False
        handed_out = [self._take_block() for _ in range(max(0, missing))]
        if handed_out:
            # Kernels read whole blocks and mask the positions not yet written: those must hold
            # zeros, never stale bits that could be NaN.
            self._zero(handed_out)
            table.extend(handed_out)
        return True

    def _take_block(self) -> int:
        """A free block, else the least recently used cached one, its name forgotten."""
        if self.free_list:
            block = self.free_list.popleft()
        else:
            block, _ = self.cached.popitem(last=False)
            del self.by_hash[self.hash_of.pop(block)]
        self.ref_counts[block] = 1
        return block

    def _zero(self, blocks: list[int]) -> None:
        index = torch.tensor(blocks, device=self.keys[0].device if self.keys else None)
        for tensor in self.keys + self.values:
            tensor.index_fill_(0, index, 0)

    def free(self, seq_id: int) -> None:
        # Last block first: a sequence's tail is the part least likely to be shared, so it is evicted first.
        for block in reversed(self.tables.pop(seq_id, [])):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if block in self.hash_of:
                    self.cached[block] = None
                else:
                    self.free_list.appendleft(block)

    def truncate(self, seq_id: int, tokens: int) -> None:
        table = self.tables.get(seq_id)
        if not table:
            return
        keep, offset = blocks_for(tokens, self.block_size), tokens % self.block_size
        touched = table[keep - 1 if offset else keep:]
        if any(block in self.hash_of or self.ref_counts[block] > 1 for block in touched):
            raise ValueError(f"sequence {seq_id}: truncating it to {tokens} positions would change a named or "
                             "shared block")
        for block in reversed(table[keep:]):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_list.appendleft(block)
        del table[keep:]
        if offset and table:
            first = table[-1] * self.block_size
            slots = torch.arange(first + offset, first + self.block_size, device=self.keys[0].device)
            for tensor in self.keys + self.values:  # index_fill_, as in _zero: float8 pools have it
                tensor.view(-1, *tensor.shape[2:]).index_fill_(0, slots, 0)

    def free_all(self) -> None:
        for seq_id in list(self.tables):
            self.free(seq_id)

    def release_memory(self) -> int:
        """Give every block's memory back to the operating system, the cached blocks' names with it, while
        no sequence holds a block (the server sleeps); blocks take memory again as they are written. How
        many bytes went back."""
        if self.tables:
            raise RuntimeError(f"{len(self.tables)} sequences still hold blocks: their memory cannot go back")
        self.drop_cached()
        return sum(release_pages(tensor) for tensor in self.keys + self.values)

    def bytes_per_block(self) -> int:
        tensor = self.keys[0] if self.keys else None
        if tensor is None:
            return 0
        return 2 * len(self.keys) * tensor[0].nelement() * tensor.element_size()

    # ---- prefix caching -------------------------------------------------------------------

    def lookup(self, hashes: list[bytes]) -> list[int]:
        found = []
        for block_hash in hashes:
            block = self.by_hash.get(block_hash)
            if block is None:
                break
            found.append(block)
        return found

    def idle_among(self, blocks: list[int]) -> int:
        return sum(1 for block in blocks if self.ref_counts[block] == 0)

    def share(self, seq_id: int, blocks: list[int]) -> None:
        assert not self.tables.get(seq_id), "a sequence takes cached blocks only before it holds any"
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self.cached[block]
            self.ref_counts[block] += 1
        self.tables[seq_id] = list(blocks)

    def name(self, block: int, block_hash: bytes) -> bool:
        if block_hash in self.by_hash or block in self.hash_of:
            return False
        self.by_hash[block_hash] = block
        self.hash_of[block] = block_hash
        return True

    def unname(self, block: int) -> None:
        block_hash = self.hash_of.pop(block, None)
        if block_hash is None:
            return
        del self.by_hash[block_hash]
        if block in self.cached:
            del self.cached[block]
            self.free_list.appendleft(block)

    def drop_cached(self) -> int:
        dropped = list(self.cached)
        for block in dropped:
            self.unname(block)
        return len(dropped)

    def cached_blocks(self) -> int:
        return len(self.hash_of)


class PagedKVAllocator(KVAllocator):
    name = "paged"
    layout = "paged"
    description = ("fixed-size blocks per layer with a free list, block tables and reference counts; "
                   "finished sequences' full blocks stay cached for prompts that begin the same way")

    def create(self, model_config: Any, dtype: torch.dtype, device: torch.device, max_tokens: int,
               block_size: int) -> BlockPool:
        layers, kv_heads, head_dim = model_kv_shape(model_config)
        num_blocks = max(1, blocks_for(max_tokens, block_size))  # whole blocks: never fewer positions than asked
        return PagedPool(layers, num_blocks, block_size, kv_heads, head_dim, dtype, device)


@tokenmill.hookimpl
def tokenmill_kv_allocators() -> list[KVAllocator]:
    return [PagedKVAllocator()]
