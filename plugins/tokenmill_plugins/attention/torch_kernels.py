"""Attention in PyTorch: SDPA and eager for the padded layout; for the paged one, SDPA over
gathered blocks, with decode rows on CPU read straight from the pool by tokenmill's native
kernel where it builds, and bfloat16 prompt chunks on CPU by its flash-attention kernel where the
CPU has AVX512-BF16."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import tokenmill
from tokenmill.interfaces import AttentionKernel, PagedStep, blocks_for
from tokenmill.kernels import native as native_kernels


def _group_plan(step: PagedStep, rows: list[int], sliding_window: int | None) -> dict[str, Any]:
    """Index and mask tensors for some of a step's sequences, attended in one SDPA call.

    Each sequence gets a row: its query tokens padded to the group's longest query,
    and its blocks (whole blocks: copying them is about twice as fast as copying
    positions) padded to the group's most blocks. Padding blocks are block 0, which
    the pool keeps zeroed; positions past a sequence's context are masked out. A whole
    prompt prefilled at once needs no mask: plain causal attention skips half the work.
    So does a prompt after a short cached prefix, with a dummy query row for each cached
    position (see :data:`CAUSAL_PADDING_RATIO`).
    """
    device = step.slot_mapping.device
    block_size = step.pool.block_size
    index = torch.tensor(rows, device=device)
    query_lens = [step.query_lens[r] for r in rows]
    widest = max(blocks_for(step.context_lens[r], block_size) for r in rows)
    context = torch.tensor([step.context_lens[r] for r in rows], device=device)
    lengths = torch.tensor(query_lens, device=device)
    positions = torch.arange(widest * block_size, device=device)
    offsets = torch.arange(max(query_lens), device=device)
    query_valid = offsets < lengths[:, None]
    starts = torch.tensor([step.query_starts[r] for r in rows], device=device)
    query_index = (starts[:, None] + offsets).masked_fill(~query_valid, 0)
    query_positions = context[:, None] - lengths[:, None] + offsets  # absolute position of each query
    shape = (len(rows), max(query_lens), widest * block_size)
    blocks = step.block_tables.index_select(0, index)[:, :widest].flatten().long()
    before = step.context_lens[rows[0]] - query_lens[0]  # context positions that precede the queries
    if len(rows) == 1 and before * CAUSAL_PADDING_RATIO <= query_lens[0] and not sliding_window:
        # Causal from the first position: a dummy row (any query) for each earlier position, output dropped.
        tokens = query_index.flatten()
        return {"blocks": blocks, "query_index": torch.cat([tokens[:1].expand(before), tokens]),
                "valid_rows": torch.arange(before, before + query_lens[0], device=device), "tokens": tokens,
                "mask": None, "shape": (1, before + query_lens[0], shape[2])}
    visible = (positions[None, None, :] <= query_positions[:, :, None]) & (positions < context[:, None])[:, None, :]
    if sliding_window:
        visible &= positions[None, None, :] > query_positions[:, :, None] - sliding_window
    visible &= query_valid[:, :, None]
    visible[:, :, 0] |= ~query_valid  # padded query rows see one (zero) key instead of none: no NaN
    return {
        "blocks": blocks,
        "query_index": query_index.flatten(),
        "valid_rows": query_valid.flatten().nonzero().squeeze(1),
        "tokens": query_index[query_valid],  # where each valid query sits in the packed step
        "mask": visible[:, None],
        "shape": shape,
    }


CAUSAL_PADDING_RATIO = 16
"""A prefill chunk after ``n`` context positions (a cached prefix) runs as plain causal attention over
``n`` dummy query rows and its own when it is at least this × ``n`` long, else with a mask over its own
rows. On 2 CPU cores, SmolLM2's shapes: 16 cached and 1,000 new tokens take 9.9 ms a layer padded and
13.8 ms masked; 32 and 500 take the same either way; 300 and 300, 4.1 ms padded and 2.6 ms masked."""

GROUP_OVERHEAD_BLOCKS = 48
"""What one more attention call per layer costs, in blocks gathered: the point at which
splitting the decode rows into two groups pays for the padding it saves. On 2 CPU cores,
32 decoding sequences of the bench prompts step equally fast with any value from 8 to 96
and 15 % slower at 192; without groups (one group padded to the longest) 4.5× slower."""


def decode_groups(context_blocks: dict[int, int]) -> list[list[int]]:
    """Decode rows (row -> blocks of context) in groups, each padded to its widest member.

    Rows are taken widest first. Opening a new group at a row saves at least the
    difference in width for that row and every narrower one after it; it opens when that
    saving exceeds the cost of one more attention call per layer."""
    order = sorted(context_blocks, key=context_blocks.__getitem__, reverse=True)
    groups: list[list[int]] = []
    widest = 0
    for index, row in enumerate(order):
        blocks = context_blocks[row]
        if groups and (widest - blocks) * (len(order) - index) <= GROUP_OVERHEAD_BLOCKS:
            groups[-1].append(row)
        else:
            groups.append([row])
            widest = blocks
    return [sorted(group) for group in groups]  # in step order: one group's output needs no reordering


SHORT_QUERY = 8
"""Rows of at most this many query tokens (a decoding sequence's newest token and its draft, a short
chunk) attend as decode rows: with the native kernel one kernel row per query token, with SDPA in the
padded decode groups. Longer ones are prompt chunks, each in its own SDPA call."""


def _native_decode_plan(step: PagedStep, rows: list[int]) -> dict[str, Any]:
    """All decode rows in one call of the native kernel, which reads each sequence's own blocks. A row of
    several query tokens becomes one kernel row per token, each seeing the context up to its own position."""
    device = step.slot_mapping.device
    tokens, tables, contexts = [], [], []
    for row in rows:
        length, context = step.query_lens[row], step.context_lens[row]
        for offset in range(length):
            tokens.append(step.query_starts[row] + offset)
            tables.append(row)
            contexts.append(context - length + 1 + offset)
    return {"native": True, "tokens": torch.tensor(tokens, device=device),
            "block_tables": step.block_tables.index_select(0, torch.tensor(tables, device=device)),
            "context_lens": torch.tensor(contexts, device=device)}


def _native_prefill_plan(step: PagedStep, rows: list[int]) -> dict[str, Any]:
    """All prompt chunks in one call of the native prefill kernel, which reads each sequence's own blocks."""
    device = step.slot_mapping.device
    return {"prefill": True, "block_tables": step.block_tables.index_select(0, torch.tensor(rows, device=device)),
            "query_starts": torch.tensor([step.query_starts[r] for r in rows]),
            "query_lens": torch.tensor([step.query_lens[r] for r in rows]),
            "context_lens": torch.tensor([step.context_lens[r] for r in rows])}


def _step_plan(step: PagedStep, sliding_window: int | None, native: bool, native_prefill: bool
               ) -> list[dict[str, Any]]:
    """Decode rows (short ones: :data:`SHORT_QUERY`) in groups of similar context length (or all in one
    native call); each prefill chunk in its own group, so that no sequence is padded to another's prompt length
    (or all in one call of the native prefill kernel)."""
    block_size = step.pool.block_size
    decoding = {r: blocks_for(step.context_lens[r], block_size)
                for r, n in enumerate(step.query_lens) if n <= SHORT_QUERY}
    prefilling = [r for r, n in enumerate(step.query_lens) if n > SHORT_QUERY]
    if native_prefill and prefilling:
        plans = [_native_prefill_plan(step, prefilling)]
    else:
        plans = [_group_plan(step, [r], sliding_window) for r in prefilling]
    if native and decoding:
        return [_native_decode_plan(step, sorted(decoding))] + plans
    return [_group_plan(step, rows, sliding_window) for rows in decode_groups(decoding)] + plans


class SdpaAttention(AttentionKernel):
    name = "sdpa"
    layouts = ("padded", "paged")
    transformers_name = "sdpa"
    description = ("torch scaled_dot_product_attention; paged: gathers each sequence's blocks (CPU and GPU), "
                   "decode rows on CPU by tokenmill's native kernel when it builds, bfloat16 prompt chunks on CPU "
                   "by its flash-attention kernel where the CPU has AVX512-BF16")

    def __init__(self) -> None:
        self._workspace: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}
        self._native: bool | None = None
        """Whether decode rows on CPU go to the native kernel: decided (and built) at the first paged step."""
        self._native_prefill: bool | None = None
        """Whether bfloat16 prompt chunks on CPU go to the native prefill kernel: decided (and built) at the
        first bfloat16 paged step."""

    def _use_native(self, device: torch.device) -> bool:
        if device.type != "cpu":
            return False
        if self._native is None:
            self._native = native_kernels.native_unavailable_reason() is None
        return self._native

    def _use_native_prefill(self, query: torch.Tensor, key_cache: torch.Tensor) -> bool:
        heads, head_dim = query.shape[1], query.shape[2]
        if query.device.type != "cpu" or query.dtype != torch.bfloat16 or key_cache.dtype != torch.bfloat16:
            return False
        if head_dim % 16 or head_dim > 256 or heads // key_cache.shape[2] > 64:
            return False
        if self._native_prefill is None:
            self._native_prefill = native_kernels.prefill_unavailable_reason() is None
        return self._native_prefill

    def paged_attention(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        step: PagedStep, scaling: float, sliding_window: int | None = None) -> torch.Tensor:
        key = f"sdpa:{sliding_window}"
        plans = step.scratch.get(key)
        if plans is None:
            plans = step.scratch[key] = _step_plan(step, sliding_window, self._use_native(query.device),
                                                   self._use_native_prefill(query, key_cache))
        decode_only = max(step.query_lens) == 1
        if len(plans) == 1 and decode_only:  # one decode group: tokens already in order
            return self._run(query, key_cache, value_cache, plans[0], scaling, sliding_window, decode=True)
        out = torch.empty_like(query)
        for plan in plans:
            if plan.get("prefill"):
                native_kernels.paged_prefill(query, key_cache, value_cache, plan["block_tables"], plan["query_starts"],
                                             plan["query_lens"], plan["context_lens"], sliding_window, scaling, out)
            else:
                out.index_copy_(0, plan["tokens"],
                                self._run(query, key_cache, value_cache, plan, scaling, sliding_window))
        return out

    def _run(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, plan: dict[str, Any],
             scaling: float, sliding_window: int | None, decode: bool = False) -> torch.Tensor:
        if plan.get("native"):
            rows = query if decode else query.index_select(0, plan["tokens"])
            return native_kernels.paged_decode(rows, key_cache, value_cache, plan["block_tables"],
                                               plan["context_lens"], sliding_window, scaling)
        return self._attend(query, key_cache, value_cache, plan, scaling, decode)

    def _gather(self, name: str, cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """``cache``'s rows ``blocks``, copied into a buffer that every layer and step reuses: a fresh
        tensor of this size per layer would cost an allocation and its page faults each time."""
        rows = cache.view(cache.shape[0], -1)
        needed = blocks.numel() * rows.shape[1]
        slot = (name, cache.dtype, cache.device)
        buffer = self._workspace.get(slot)
        if buffer is None or buffer.numel() < needed:
            buffer = self._workspace[slot] = torch.empty(needed, dtype=cache.dtype, device=cache.device)
        out = buffer[:needed].view(blocks.numel(), rows.shape[1])
        # index_select, not advanced indexing: several times faster for gathering rows on CPU.
        return torch.index_select(rows, 0, blocks, out=out)

    def _attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                plan: dict[str, Any], scaling: float, decode: bool = False) -> torch.Tensor:
        kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
        sequences, longest_query, context = plan["shape"]
        keys = self._gather("keys", key_cache, plan["blocks"]).view(sequences, context, kv_heads, head_dim)
        values = self._gather("values", value_cache, plan["blocks"]).view(sequences, context, kv_heads, head_dim)
        if keys.dtype != query.dtype:  # a float8 pool (--kv-cache-dtype): attend in the model's dtype
            keys, values = keys.to(query.dtype), values.to(query.dtype)
        queries = query if decode else query.index_select(0, plan["query_index"])
        queries = queries.view(sequences, longest_query, -1, head_dim).transpose(1, 2)
        half_on_cpu = query.dtype != torch.float32 and query.device.type == "cpu"
        if longest_query == 1 and half_on_cpu and plan["mask"] is not None:
            out = _decode_attention(queries, keys, values, plan["mask"], scaling)
        else:
            out = F.scaled_dot_product_attention(queries, keys.transpose(1, 2), values.transpose(1, 2),
                                                 attn_mask=plan["mask"], is_causal=plan["mask"] is None,
                                                 scale=scaling, enable_gqa=query.shape[1] != kv_heads)
        out = out.transpose(1, 2).reshape(sequences * longest_query, -1, head_dim)
        return out if decode else out.index_select(0, plan["valid_rows"])


def _decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      scaling: float) -> torch.Tensor:
    """One query token per sequence, as two batched matmuls with the softmax in float32.

    ``query`` ``[seqs, heads, 1, dim]``; ``keys``/``values`` ``[seqs, context, kv_heads, dim]``;
    ``mask`` ``[seqs, 1, 1, context]``. On CPU, SDPA's half-precision kernel is several times
    slower than this for a single query row."""
    sequences, heads, _, head_dim = query.shape
    kv_heads = keys.shape[2]
    grouped = query.reshape(sequences, kv_heads, heads // kv_heads, head_dim)
    scores = torch.matmul(grouped, keys.permute(0, 2, 3, 1).contiguous()).float() * scaling
    scores = scores.masked_fill_(~mask, float("-inf")).softmax(-1).to(values.dtype)
    out = torch.matmul(scores, values.transpose(1, 2).contiguous())
    return out.reshape(sequences, heads, 1, head_dim)


class EagerAttention(AttentionKernel):
    name = "eager"
    layouts = ("padded",)
    transformers_name = "eager"
    description = "plain matmul + softmax attention, the reference implementation"


@tokenmill.hookimpl
def tokenmill_attention_kernels() -> list[AttentionKernel]:
    return [SdpaAttention(), EagerAttention()]
