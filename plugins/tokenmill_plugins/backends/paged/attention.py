"""How the paged backends route the model's attention: transformers' ``AttentionInterface`` calls
:func:`paged_attention_forward`, which writes the step's keys and values into the sequences' blocks
and lets the attention kernel plugin attend over them.

A compiled forward calls it as the opaque operator ``tokenmill::paged_attention``, which finds its
step in :data:`current_step`: a compiled graph takes tensors, and a Python object passed in would
make it recompile at every step.
"""

from __future__ import annotations

import contextvars
from typing import Any

import torch

from tokenmill.interfaces import PagedStep
from tokenmill.kernels import native as native_kernels

ATTENTION_NAME = "tokenmill_paged"

current_step: contextvars.ContextVar[PagedStep] = contextvars.ContextVar("tokenmill_paged_step")
"""The step a compiled forward is running; set by the paged runner for that call only."""


@torch.library.custom_op("tokenmill::paged_attention", mutates_args=())
def _paged_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int,
                        scaling: float, sliding_window: int) -> torch.Tensor:
    """:func:`paged_attention_forward` as one operator a compiled graph calls as it is (0: no window)."""
    step = current_step.get(None)
    if step is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention was called outside a tokenmill paged step")
    return _attend(step, layer_idx, query, key, value, scaling, sliding_window or None)


@_paged_attention_op.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int, scaling: float,
      sliding_window: int) -> torch.Tensor:
    return query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])


def paged_attention_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                            paged_step: PagedStep | None = None, sliding_window: int | None = None,
                            **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ``query`` ``[1, heads, tokens, dim]``, ``key``/``value``
    ``[1, kv_heads, tokens, dim]`` for this step's tokens; returns ``[1, tokens, heads, dim]``.
    A compiled forward passes no ``paged_step``: the operator finds it in :data:`current_step`."""
    if kwargs.get("softcap") or kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention logit soft-capping and sinks are not supported by the paged backend")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if paged_step is None:
        return _paged_attention_op(query, key, value, module.layer_idx, scale, sliding_window or 0), None
    return _attend(paged_step, module.layer_idx, query, key, value, scale, sliding_window), None


def _attend(paged_step: PagedStep, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            scale: float, sliding_window: int | None) -> torch.Tensor:
    """Write this step's keys and values into the sequences' blocks, then attend over them."""
    key_cache, value_cache = paged_step.pool.layer(layer_idx)
    if _stores_natively(paged_step, key, key_cache):
        native_kernels.store_kv(key, value, key_cache, value_cache, paged_step.slot_mapping)
    else:
        _store(paged_step, key, value, key_cache, value_cache)
    out = paged_step.kernel.paged_attention(query[0].transpose(0, 1), key_cache, value_cache, paged_step, scale,
                                            sliding_window)
    return out.unsqueeze(0).to(query.dtype)


def _stores_natively(paged_step: PagedStep, key: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether this step's keys and values go into the pool through the native ``store_kv`` (one call a layer
    instead of two copies over transposed views): on CPU, into a pool of the model's dtype. Decided once a step."""
    decided = paged_step.scratch.get("native_store")
    if decided is None:
        decided = paged_step.scratch["native_store"] = (
            key_cache.device.type == "cpu" and key.dtype == key_cache.dtype and paged_step.slot_mapping.dtype
            == torch.long and native_kernels.native_unavailable_reason() is None)
    return decided


def _store(paged_step: PagedStep, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
           value_cache: torch.Tensor) -> None:
    kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    key, value = key[0].transpose(0, 1), value[0].transpose(0, 1)
    if key_cache.dtype == torch.float8_e4m3fn:  # casting saturates nothing: |x| >= 480 would become NaN
        key, value = key.clamp(-448, 448), value.clamp(-448, 448)
    key_cache.view(-1, kv_heads, head_dim).index_copy_(0, paged_step.slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, kv_heads, head_dim).index_copy_(0, paged_step.slot_mapping, value.to(value_cache.dtype))
