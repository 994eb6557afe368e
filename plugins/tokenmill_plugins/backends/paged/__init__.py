"""The ``paged`` and ``flash`` backends: packed steps over a block pool, on the unmodified model.

Each step packs the tokens of every scheduled sequence (prefill chunks, and decode tokens with
their drafts under ``--speculate``) into one row, with each token's own position. The model runs
with transformers' attention routed, through ``AttentionInterface``, to the kernel plugin (see
:mod:`.attention`), which attends, per sequence, over its own blocks. Any model whose layers
use that interface runs this way. ``flash`` is the same backend with the flash-attn kernel.

The engine allocates the blocks (:mod:`tokenmill.engine.kv_cache`); the runner (:mod:`.runner`) packs
each step over them and runs the forward, compiled on CPU where it can be.
"""

from __future__ import annotations

from typing import Any

import torch

import tokenmill
from tokenmill.interfaces import AttentionKernel, Backend, BackendRunner, BlockPool
from tokenmill.kernels.accelerators import flash_attn_unavailable_reason
from tokenmill.model.compat import packed_steps_unavailable_reason
from tokenmill.model.kv_memory import model_kv_shape
from tokenmill.model.vision import takes_images
from tokenmill_plugins.backends.paged.attention import ATTENTION_NAME, paged_attention_forward
from tokenmill_plugins.backends.paged.runner import PagedRunner

__all__ = ["FlashBackend", "PagedBackend", "PagedRunner"]


class PagedBackend(Backend):
    name = "paged"
    kv_layout = "paged"
    mixed_steps = True
    default_attention = "sdpa"
    default_kv_allocator = "paged"
    description = "packed steps over a block pool, KV allocated on demand (any model using AttentionInterface)"

    def model_unavailable_reason(self, model: Any) -> str | None:
        return packed_steps_unavailable_reason(model, self.name) or super().model_unavailable_reason(model)

    def create(self, model: Any, kv_store: BlockPool, attention: AttentionKernel) -> BackendRunner:
        reason = self.model_unavailable_reason(model)
        if reason:
            raise ValueError(reason)
        from transformers import AttentionInterface  # here, not at the top: importing it costs seconds

        AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
        # A vision tower keeps its own attention: only the language model's attends over the blocks.
        model.set_attn_implementation({"text_config": ATTENTION_NAME} if takes_images(model.config) else ATTENTION_NAME)
        return PagedRunner(model, kv_store, attention)


class FlashBackend(PagedBackend):
    name = "flash"
    default_attention = "flash"
    description = "the paged backend with flash-attn's variable-length kernels (CUDA)"

    def unavailable_reason(self) -> str | None:
        return flash_attn_unavailable_reason()

    def model_unavailable_reason(self, model: Any) -> str | None:
        reason = super().model_unavailable_reason(model)
        if reason:
            return reason
        dtype = next(model.parameters()).dtype
        if dtype not in (torch.float16, torch.bfloat16):
            return (f"flash-attn runs float16 and bfloat16 only (the model is {str(dtype).replace('torch.', '')}); "
                    "use --dtype bfloat16 or --backend paged")
        _, _, head_dim = model_kv_shape(model.config)
        if head_dim > 256 or head_dim % 8:
            return (f"flash-attn needs a head dimension of at most 256 and a multiple of 8 (the model has {head_dim}); "
                    "use --backend paged")
        return None


@tokenmill.hookimpl
def tokenmill_backends() -> list[Backend]:
    return [PagedBackend(), FlashBackend()]
