"""What this machine can run: checks shared by the plugins that need an accelerator library."""

from __future__ import annotations

import functools
import inspect

import torch


@functools.cache
def flash_attn_unavailable_reason() -> str | None:
    """None when flash-attn's variable-length kernels can run here, else why not."""
    if not torch.cuda.is_available():
        return "needs CUDA (no GPU is visible)"
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception as error:  # noqa: BLE001 - a broken build fails in many ways
        return f"flash-attn is not installed or does not load ({type(error).__name__}); pip install 'tokenmill[flash]'"
    if "block_table" not in inspect.signature(flash_attn_varlen_func).parameters:
        return "flash-attn is too old for paged KV (flash_attn_varlen_func has no block_table; needs 2.6 or later)"
    return None
