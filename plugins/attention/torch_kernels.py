"""Attention in plain PyTorch: SDPA and eager for the padded layout, SDPA over gathered blocks for the paged one."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import tokenmill
from tokenmill.interfaces import AttentionKernel, PagedStep


def _gather_plan(step: PagedStep, sliding_window: int | None) -> dict[str, torch.Tensor]:
    """Index and mask tensors for one step, built once and shared by every layer.

    Each sequence gets a row: its query tokens padded to the longest query, and its
    blocks (whole blocks: copying them is about twice as fast as copying positions)
    padded to the most blocks. Padding blocks are block 0, which the pool keeps
    zeroed; positions past a sequence's context are masked out.
    """
    device = step.slot_mapping.device
    block_size = step.pool.block_size
    sequences, widest = step.block_tables.shape
    context = torch.tensor(step.context_lens, device=device)
    query_lens = torch.tensor(step.query_lens, device=device)
    positions = torch.arange(widest * block_size, device=device)
    longest_query = max(step.query_lens)
    offsets = torch.arange(longest_query, device=device)
    query_valid = offsets < query_lens[:, None]
    query_index = (torch.tensor(step.query_starts, device=device)[:, None] + offsets).masked_fill(~query_valid, 0)
    query_positions = context[:, None] - query_lens[:, None] + offsets  # absolute position of each query
    visible = (positions[None, None, :] <= query_positions[:, :, None]) & (positions < context[:, None])[:, None, :]
    if sliding_window:
        visible &= positions[None, None, :] > query_positions[:, :, None] - sliding_window
    visible &= query_valid[:, :, None]
    visible[:, :, 0] |= ~query_valid  # padded query rows see one (zero) key instead of none: no NaN
    return {
        "blocks": step.block_tables.flatten().long(),
        "query_index": query_index.flatten(),
        "valid_rows": query_valid.flatten().nonzero().squeeze(1),  # packed order: sequence by sequence
        "mask": visible[:, None],
    }


class SdpaAttention(AttentionKernel):
    name = "sdpa"
    layouts = ("padded", "paged")
    transformers_name = "sdpa"
    description = "torch scaled_dot_product_attention; paged: gathers each sequence's blocks (CPU and GPU)"

    def paged_attention(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        step: PagedStep, scaling: float, sliding_window: int | None = None) -> torch.Tensor:
        key = f"sdpa:{sliding_window}"
        plan = step.scratch.get(key)
        if plan is None:
            plan = step.scratch[key] = _gather_plan(step, sliding_window)
        kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
        sequences, longest_query, context = plan["mask"].shape[0], plan["mask"].shape[2], plan["mask"].shape[3]
        # index_select, not advanced indexing: several times faster for gathering rows on CPU.
        keys = key_cache.view(key_cache.shape[0], -1).index_select(0, plan["blocks"])
        values = value_cache.view(value_cache.shape[0], -1).index_select(0, plan["blocks"])
        decode = longest_query == 1  # one query per sequence, in order: no gathering or picking needed
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
