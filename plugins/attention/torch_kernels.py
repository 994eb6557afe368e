"""Attention in plain PyTorch: SDPA and eager for the padded layout, SDPA over gathered blocks for the paged one."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import tokenmill
from tokenmill.interfaces import AttentionKernel, PagedStep


def _gather_plan(step: PagedStep, sliding_window: int | None) -> dict[str, torch.Tensor]:
    """Index and mask tensors for one step, built once and shared by every layer.

    Each sequence gets a row: its query tokens padded to the longest query, and its
    context's KV slots padded to the longest context. Padding slots point at block 0,
    which the pool keeps zeroed, so no uninitialised memory is ever read.
    """
    device = step.slot_mapping.device
    block_size = step.pool.block_size
    context = torch.tensor(step.context_lens, device=device)
    query_lens = torch.tensor(step.query_lens, device=device)
    positions = torch.arange(step.max_context_len, device=device)
    slots = step.block_tables[:, positions // block_size].long() * block_size + positions % block_size
    slots = slots.masked_fill(positions >= context[:, None], 0)
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
    return {"slots": slots, "query_index": query_index, "query_valid": query_valid, "mask": visible[:, None]}


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
        keys = key_cache.view(-1, kv_heads, head_dim)[plan["slots"]].transpose(1, 2)
        values = value_cache.view(-1, kv_heads, head_dim)[plan["slots"]].transpose(1, 2)
        queries = query[plan["query_index"]].transpose(1, 2)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=plan["mask"], scale=scaling,
                                             enable_gqa=queries.shape[1] != kv_heads)
        return out.transpose(1, 2)[plan["query_valid"]]


class EagerAttention(AttentionKernel):
    name = "eager"
    layouts = ("padded",)
    transformers_name = "eager"
    description = "plain matmul + softmax attention, the reference implementation"


@tokenmill.hookimpl
def tokenmill_attention_kernels() -> list[AttentionKernel]:
    return [SdpaAttention(), EagerAttention()]
