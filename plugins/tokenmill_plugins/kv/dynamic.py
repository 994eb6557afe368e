"""The ``dynamic`` KV allocator: transformers' DynamicCache, grown per step, rows per sequence.

Rows of a left-padded batch are sequences; joining a batch pads the shorter cache
on the left and concatenates rows, leaving selects rows and trims columns that
became padding for every remaining row, so memory is returned at once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

import tokenmill
from tokenmill.interfaces import KVAllocator, PaddedKVCache


def _pad_left(tensor: torch.Tensor, columns: int) -> torch.Tensor:
    """Pad ``[batch, heads, seq, dim]`` with ``columns`` zero positions at the start."""
    return F.pad(tensor, (0, 0, columns, 0)) if columns else tensor


class DynamicPaddedCache(PaddedKVCache):
    def new_cache(self, model_config: Any) -> DynamicCache:
        # Full-length layers for every model, sliding-window ones included: their masks still
        # limit attention to the window, and rows of different lengths stay aligned by column.
        return DynamicCache()

    def concat(self, first: DynamicCache, second: DynamicCache, first_len: int, second_len: int) -> DynamicCache:
        width = max(first_len, second_len)

        def joined(mine: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
            return torch.cat([_pad_left(mine, width - first_len), _pad_left(theirs, width - second_len)])

        # Build every layer before touching any, so that running out of memory leaves ``first`` whole.
        keys = [joined(a.keys, b.keys) for a, b in zip(first.layers, second.layers)]
        values = [joined(a.values, b.values) for a, b in zip(first.layers, second.layers)]
        for layer, layer_keys, layer_values in zip(first.layers, keys, values):
            layer.keys, layer.values = layer_keys, layer_values
        return first

    def select_rows(self, cache: DynamicCache, rows: torch.Tensor) -> DynamicCache:
        for layer in cache.layers:
            layer.keys = layer.keys.index_select(0, rows)
            layer.values = layer.values.index_select(0, rows)
        return cache

    def trim_left(self, cache: DynamicCache, columns: int) -> DynamicCache:
        if columns:
            for layer in cache.layers:
                layer.keys = layer.keys[:, :, columns:, :]
                layer.values = layer.values[:, :, columns:, :]
        return cache

    def nbytes(self, cache: DynamicCache | None) -> int:
        if cache is None:
            return 0
        return sum(
            layer.keys.nelement() * layer.keys.element_size() * 2
            for layer in cache.layers
            if getattr(layer, "keys", None) is not None
        )


class DynamicKVAllocator(KVAllocator):
    name = "dynamic"
    layout = "padded"
    description = "transformers' DynamicCache in a left-padded batch (the HF cache)"

    def create(self, model_config: Any, dtype: torch.dtype, device: torch.device, max_tokens: int,
               block_size: int) -> PaddedKVCache:
        return DynamicPaddedCache()  # grows with the batch: admission keeps it within max_tokens


@tokenmill.hookimpl
def tokenmill_kv_allocators() -> list[KVAllocator]:
    return [DynamicKVAllocator()]
