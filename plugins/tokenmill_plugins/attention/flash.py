"""The ``flash`` attention kernel: flash-attn's variable-length kernel reading KV straight from the blocks.

CUDA only. flash-attn's paged path needs blocks of a multiple of 256 positions.
"""

from __future__ import annotations

import torch

import tokenmill
from tokenmill.interfaces import AttentionKernel, PagedStep
from tokenmill.kernels.accelerators import flash_attn_unavailable_reason


class FlashAttention(AttentionKernel):
    name = "flash"
    layouts = ("paged",)
    block_size_multiple = 256
    description = "flash-attn flash_attn_varlen_func with block tables (CUDA)"

    def unavailable_reason(self) -> str | None:
        return flash_attn_unavailable_reason()

    def paged_attention(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        step: PagedStep, scaling: float, sliding_window: int | None = None) -> torch.Tensor:
        from flash_attn import flash_attn_varlen_func

        plan = step.scratch.get("flash")
        if plan is None:
            device = query.device

            def cumulative(lengths: list[int]) -> torch.Tensor:
                return torch.tensor([0, *lengths], device=device, dtype=torch.int32).cumsum(0, dtype=torch.int32)

            plan = step.scratch["flash"] = {
                "cu_seqlens_q": cumulative(step.query_lens),
                "cu_seqlens_k": cumulative(step.context_lens),
                "block_table": step.block_tables.to(device=device, dtype=torch.int32),
            }
        return flash_attn_varlen_func(
            query, key_cache, value_cache,
            cu_seqlens_q=plan["cu_seqlens_q"], cu_seqlens_k=plan["cu_seqlens_k"],
            max_seqlen_q=max(step.query_lens), max_seqlen_k=step.max_context_len,
            softmax_scale=scaling, causal=True,
            window_size=(sliding_window - 1, 0) if sliding_window else (-1, -1),
            block_table=plan["block_table"],
        )


@tokenmill.hookimpl
def tokenmill_attention_kernels() -> list[AttentionKernel]:
    return [FlashAttention()]
