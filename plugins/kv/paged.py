"""The ``paged`` KV allocator: one pool of fixed-size blocks per layer, shared by all sequences.

A sequence owns a block table (its blocks in order); blocks come off a free list
as it grows and go back the moment it finishes, is cancelled or is preempted.
Each block has a reference count, so that a later prefix cache can let several
sequences hold one block; it returns to the free list when the count drops to 0. Block 0 is never handed
out: it stays zeroed, so padded reads in a kernel see zeros, not garbage.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

import tokenmill
from tokenmill.interfaces import BlockPool, KVAllocator
from tokenmill.kv_memory import model_kv_shape


class PagedPool(BlockPool):
    def __init__(self, layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks + 1, block_size, kv_heads, head_dim)  # + the zero block
        # Uninitialised: on CPU the pages are only touched as blocks are handed out, so an unused
        # pool costs no RAM. Each block is zeroed when handed out (see reserve).
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
        self._zero(torch.tensor([0], device=device))
        self.free_list: deque[int] = deque(range(1, num_blocks + 1))
        self.ref_counts = [0] * (num_blocks + 1)
        self.tables: dict[int, list[int]] = {}

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[index], self.values[index]

    def free_blocks(self) -> int:
        return len(self.free_list)

    def blocks_of(self, seq_id: int) -> list[int]:
        return self.tables.get(seq_id, [])

    def reserve(self, seq_id: int, tokens: int) -> bool:
        table = self.tables.setdefault(seq_id, [])
        missing = -(-tokens // self.block_size) - len(table)
        if missing > len(self.free_list):
            if not table:
                del self.tables[seq_id]
            return False
        handed_out = [self.free_list.popleft() for _ in range(max(0, missing))]
        for block in handed_out:
            self.ref_counts[block] = 1
        if handed_out:
            # Kernels read whole blocks and mask the positions not yet written: those must hold
            # zeros, never stale bits that could be NaN.
            self._zero(torch.tensor(handed_out, device=self.keys[0].device if self.keys else None))
            table.extend(handed_out)
        return True

    def _zero(self, blocks: torch.Tensor) -> None:
        for tensor in self.keys + self.values:
            tensor.index_fill_(0, blocks, 0)

    def free(self, seq_id: int) -> None:
        for block in self.tables.pop(seq_id, []):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_list.append(block)

    def free_all(self) -> None:
        for seq_id in list(self.tables):
            self.free(seq_id)

    def bytes_per_block(self) -> int:
        tensor = self.keys[0] if self.keys else None
        if tensor is None:
            return 0
        return 2 * len(self.keys) * tensor[0].nelement() * tensor.element_size()


class PagedKVAllocator(KVAllocator):
    name = "paged"
    layout = "paged"
    description = "fixed-size blocks per layer with a free list, block tables and reference counts"

    def create(self, model_config: Any, dtype: torch.dtype, device: torch.device, max_tokens: int,
               block_size: int) -> BlockPool:
        layers, kv_heads, head_dim = model_kv_shape(model_config)
        num_blocks = max(1, -(-max_tokens // block_size))  # whole blocks: never fewer positions than asked
        return PagedPool(layers, num_blocks, block_size, kv_heads, head_dim, dtype, device)


@tokenmill.hookimpl
def tokenmill_kv_allocators() -> list[KVAllocator]:
    return [PagedKVAllocator()]
