"""How much KV memory a model needs per position, from its transformers config."""

from __future__ import annotations

from typing import Any

import torch


def model_kv_shape(model_config: Any) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a transformers config."""
    text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    return text_config.num_hidden_layers, kv_heads, head_dim


def bytes_per_token(model_config: Any, dtype: torch.dtype) -> int:
    """Bytes of keys and values one position takes over all layers."""
    layers, kv_heads, head_dim = model_kv_shape(model_config)
    return 2 * layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8
