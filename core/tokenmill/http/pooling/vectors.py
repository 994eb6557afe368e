"""What the routes make of the engine's rows: embeddings cut and normalized, cosine scores, relevance
scores from a cross-encoder's logits, and OpenAI's base64 form."""

from __future__ import annotations

import base64

import torch

from tokenmill.http.schemas import ValidationError
from tokenmill.model.pooling import PoolingModel


def check_dimensions(model: PoolingModel, dimensions: int | None) -> None:
    """``dimensions`` is allowed for a model trained for it (its config's ``matryoshka_dimensions``, or
    ``is_matryoshka`` for any size), as vLLM allows it; the full width is always allowed."""
    if dimensions is None or dimensions == model.width:
        return
    if model.matryoshka and dimensions not in model.matryoshka:
        raise ValidationError(f"`dimensions` must be one of {list(model.matryoshka)} for this model. "
                              f"Given: {dimensions}")
    if not model.matryoshka and not model.any_dimensions:
        raise ValidationError(f"`dimensions`: this model's embeddings have {model.width} dimensions and it was "
                              "not trained to be cut (no matryoshka_dimensions in its config)")
    if dimensions > model.width:
        raise ValidationError(f"`dimensions` must be <= {model.width}. Given: {dimensions}")


def embedding(row: torch.Tensor, normalize: bool, dimensions: int | None = None) -> torch.Tensor:
    """A pooled row cut to ``dimensions`` (when given), then to unit length when ``normalize``."""
    if dimensions is not None:
        row = row[:dimensions]
    return torch.nn.functional.normalize(row, dim=0) if normalize else row


def as_base64(row: torch.Tensor) -> str:
    """OpenAI's ``encoding_format: base64``: the little-endian float32 bytes, base64-encoded."""
    return base64.b64encode(row.to(torch.float32).numpy().astype("<f4").tobytes()).decode("ascii")


def cosine(first: torch.Tensor, second: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(first, second, dim=0))


def relevance(logits: torch.Tensor, raw: bool = False) -> float:
    """A cross-encoder's score of a pair: one logit through a sigmoid (sentence-transformers' CrossEncoder
    default), or with several labels the softmax probability of the last (the "relevant" label of a
    binary classifier); ``raw``: the logit itself (TEI's ``raw_scores``)."""
    if logits.numel() == 1:
        return float(logits[0]) if raw else float(torch.sigmoid(logits[0]))
    return float(logits[-1]) if raw else float(torch.softmax(logits, dim=0)[-1])
