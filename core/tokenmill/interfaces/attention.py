"""The attention kind: the kernel the model's layers call, and the layout of a paged step it reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenmill.interfaces.base import Implementation

if TYPE_CHECKING:
    import torch

    from tokenmill.interfaces.kv import BlockPool


class AttentionKernel(Implementation):
    """An attention implementation the model's layers call.

    For the ``padded`` layout it names one of transformers' own implementations
    (``transformers_name``); for the ``paged`` layout it computes attention over
    the blocks of a :class:`BlockPool` (``paged_attention``).
    """

    kind = "attention"
    layouts: tuple[str, ...] = ("padded",)
    transformers_name: str = ""
    """The ``attn_implementation`` value transformers knows this kernel by (padded layout)."""
    block_size_multiple: int = 1
    """Block sizes this kernel accepts must be multiples of this (paged layout)."""

    def paged_attention(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        step: PagedStep, scaling: float, sliding_window: int | None = None) -> torch.Tensor:
        """Causal attention of a packed step: ``query`` is ``[tokens, heads, dim]``; the caches are
        ``[blocks, block_size, kv_heads, dim]`` and already hold this step's keys and values; a
        ``sliding_window`` limits each query to that many latest positions. Returns ``[tokens, heads, dim]``."""
        raise NotImplementedError


@dataclass
class PagedStep:
    """The layout of one packed forward pass, built once per step and read by every layer."""

    pool: BlockPool
    kernel: AttentionKernel
    slot_mapping: torch.Tensor
    """``[tokens]``: the flat KV slot (block × block_size + offset) of each token of the step."""
    query_starts: list[int]
    """Per sequence, where its tokens start in the packed step."""
    query_lens: list[int]
    context_lens: list[int]
    """Per sequence, its positions in the cache after this step (the keys its queries see)."""
    block_tables: torch.Tensor
    """``[sequences, max_blocks]`` int32, padded with 0."""
    max_context_len: int
    scratch: dict[str, Any] = field(default_factory=dict)
    """Where a kernel keeps what it derives once per step (index tensors, masks) for every layer."""
