"""Attention kernels from transformers' own implementations: PyTorch SDPA and eager."""

from __future__ import annotations

import tokenmill
from tokenmill.interfaces import AttentionKernel


class SdpaAttention(AttentionKernel):
    name = "sdpa"
    transformers_name = "sdpa"
    description = "torch.nn.functional.scaled_dot_product_attention (CPU and GPU)"


class EagerAttention(AttentionKernel):
    name = "eager"
    transformers_name = "eager"
    description = "plain matmul + softmax attention, the reference implementation"


@tokenmill.hookimpl
def tokenmill_attention_kernels() -> list[AttentionKernel]:
    return [SdpaAttention(), EagerAttention()]
