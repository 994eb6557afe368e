"""Attention in plain PyTorch: SDPA and eager for the padded layout, SDPA over gathered blocks for the paged one."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import tokenmill
from tokenmill.interfaces import AttentionKernel, PagedStep


def _group_plan(step: PagedStep, rows: list[int], sliding_window: int | None) -> dict[str, torch.Tensor]:
    """Index and mask tensors for some of a step's sequences, attended in one SDPA call.

    Each sequence gets a row: its query tokens padded to the group's longest query,
    and its blocks (whole blocks: copying them is about twice as fast as copying
    positions) padded to the group's most blocks. Padding blocks are block 0, which
    the pool keeps zeroed; positions past a sequence's context are masked out.
    """
    device = step.slot_mapping.device
    block_size = step.pool.block_size
    index = torch.tensor(rows, device=device)
    query_lens = [step.query_lens[r] for r in rows]
    widest = max(-(-step.context_lens[r] // block_size) for r in rows)
    context = torch.tensor([step.context_lens[r] for r in rows], device=device)
    lengths = torch.tensor(query_lens, device=device)
    positions = torch.arange(widest * block_size, device=device)
    offsets = torch.arange(max(query_lens), device=device)
    query_valid = offsets < lengths[:, None]
    starts = torch.tensor([step.query_starts[r] for r in rows], device=device)
    query_index = (starts[:, None] + offsets).masked_fill(~query_valid, 0)
    query_positions = context[:, None] - lengths[:, None] + offsets  # absolute position of each query
    visible = (positions[None, None, :] <= query_positions[:, :, None]) & (positions < context[:, None])[:, None, :]
    if sliding_window:
        visible &= positions[None, None, :] > query_positions[:, :, None] - sliding_window
    visible &= query_valid[:, :, None]
    visible[:, :, 0] |= ~query_valid  # padded query rows see one (zero) key instead of none: no NaN
    return {
        "blocks": step.block_tables.index_select(0, index)[:, :widest].flatten().long(),
        "query_index": query_index.flatten(),
        "valid_rows": query_valid.flatten().nonzero().squeeze(1),
        "tokens": query_index[query_valid],  # where each valid query sits in the packed step
        "mask": visible[:, None],
    }


def _step_plan(step: PagedStep, sliding_window: int | None) -> list[dict[str, torch.Tensor]]:
    """Decode tokens in one group; each prefill chunk in its own, so that no sequence is padded
    to another's prompt length."""
    decoding = [r for r, n in enumerate(step.query_lens) if n == 1]
    prefilling = [r for r, n in enumerate(step.query_lens) if n > 1]
    groups = [decoding] if decoding else []
    groups += [[r] for r in prefilling]
    return [_group_plan(step, rows, sliding_window) for rows in groups]


class SdpaAttention(AttentionKernel):
    name = "sdpa"
    layouts = ("padded", "paged")
    transformers_name = "sdpa"
    description = "torch scaled_dot_product_attention; paged: gathers each sequence's blocks (CPU and GPU)"

    def paged_attention(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        step: PagedStep, scaling: float, sliding_window: int | None = None) -> torch.Tensor:
        key = f"sdpa:{sliding_window}"
        plans = step.scratch.get(key)
        if plans is None:
            plans = step.scratch[key] = _step_plan(step, sliding_window)
        if len(plans) == 1 and max(step.query_lens) == 1:  # a pure decode step: tokens already in order
            return self._attend(query, key_cache, value_cache, plans[0], scaling, decode=True)
        out = torch.empty_like(query)
        for plan in plans:
            out.index_copy_(0, plan["tokens"], self._attend(query, key_cache, value_cache, plan, scaling))
        return out

    @staticmethod
    def _attend(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                plan: dict[str, torch.Tensor], scaling: float, decode: bool = False) -> torch.Tensor:
        kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
        sequences, longest_query, context = plan["mask"].shape[0], plan["mask"].shape[2], plan["mask"].shape[3]
        # index_select, not advanced indexing: several times faster for gathering rows on CPU.
        keys = key_cache.view(key_cache.shape[0], -1).index_select(0, plan["blocks"])
        values = value_cache.view(value_cache.shape[0], -1).index_select(0, plan["blocks"])
        queries = query if decode else query.index_select(0, plan["query_index"])
        out = F.scaled_dot_product_attention(
            queries.view(sequences, longest_query, -1, head_dim).transpose(1, 2),
            keys.view(sequences, context, kv_heads, head_dim).transpose(1, 2),
            values.view(sequences, context, kv_heads, head_dim).transpose(1, 2),
            attn_mask=plan["mask"], scale=scaling, enable_gqa=query.shape[1] != kv_heads,
        )
        out = out.transpose(1, 2).reshape(sequences * longest_query, -1, head_dim)
        return out if decode else out.index_select(0, plan["valid_rows"])


class EagerAttention(AttentionKernel):
    name = "eager"
    layouts = ("padded",)
    transformers_name = "eager"
    description = "plain matmul + softmax attention, the reference implementation"


@tokenmill.hookimpl
def tokenmill_attention_kernels() -> list[AttentionKernel]:
    return [SdpaAttention(), EagerAttention()]
