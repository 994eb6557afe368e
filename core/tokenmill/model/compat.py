"""What a model needs from a backend that packs every sequence of a step into one row (the paged
and flash backends) beyond what transformers gives: attention through ``AttentionInterface``, and
no per-layer state outside the KV cache."""

from __future__ import annotations

from typing import Any

from tokenmill.model.vision import causal_unavailable_reason


def packed_steps_unavailable_reason(model: Any, backend: str) -> str | None:
    """Why ``backend`` (a packed-step backend's name) cannot run ``model``, or None."""
    name = type(model).__name__
    if not getattr(model, "_supports_attention_backend", False):
        return (f"{name} does not route attention through transformers' AttentionInterface, "
                f"so the {backend} backend cannot run it; use --backend transformers")
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    other_layers = set(getattr(config, "layer_types", None) or []) - {"full_attention", "sliding_attention"}
    if other_layers:
        return (f"{name} has {', '.join(sorted(other_layers))} layers, which keep state outside the KV cache; "
                "use --backend transformers")
    for attribute, what in (("attn_logit_softcapping", "attention logit soft-capping"),
                            ("attention_chunk_size", "chunked attention"),
                            ("num_kv_shared_layers", "layers that share another layer's KV")):
        if getattr(config, attribute, None):
            return (f"{name} uses {what}, which the {backend} backend does not implement; "
                    "use --backend transformers")
    if (reason := causal_unavailable_reason(model)) is not None:
        return reason
    if any(hasattr(module, "sinks") for module in model.modules()):
        return (f"{name} uses attention sinks, which the {backend} backend does not implement; "
                "use --backend transformers")
    return None
