"""LoRA adapters over one base model: many fine-tunes served from one set of base weights.

- :func:`install` wraps the base model's linear layers in :class:`LoraLinear` once, at start.
- An :class:`Adapter` is a PEFT checkpoint's low-rank pairs (A, B) and scale, read by
  :func:`read_peft_adapter`, which refuses one that does not fit the base model.
- :class:`AdapterCache` knows every adapter by name and keeps at most ``--lora-cache-limit`` of
  them in memory, least recently used first out; a request pins its adapter while it runs, and a
  pinned adapter is never evicted.
- Each forward pass, :func:`adapter_rows` tells the wrapped layers which rows (tokens) of the
  batch belong to which adapter, so sequences with different adapters, and none, share one
  batch step on either backend. The base weights are never touched: each layer adds
  ``scale * x A^T B^T`` to each row, for that row's adapter only.

How: the A matrices of the adapters in the batch are stacked (rank blocks side by side) and so
are their B matrices, once per set of adapters; a mask keeps, in each row, only the rank block
of that row's adapter. A layer then costs three operations whatever the number of adapters
(``x @ A_all``, the mask, an add of ``@ B_all``), where applying each adapter to its own rows
cost five per adapter: at batch 32 with 4 adapters that was 1.5x the base decode step, and
is 1.1x this way. The rows multiply rank blocks they then mask out, which is cheap next to
the base layer (ranks are small).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

TARGETABLE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The decoder layers' linear layers that adapters may target (PEFT's names for Llama-style models)."""

PEFT_PREFIX = "base_model.model."


class AdapterError(ValueError):
    """An adapter that cannot be served; the message says which and why, in one line."""


class AdapterBusy(RuntimeError):
    """Every cache slot holds an adapter that running requests use: none can be evicted now."""


@dataclass(frozen=True)
class LoraPair:
    a: torch.Tensor
    """[rank, in_features]"""
    b: torch.Tensor
    """[out_features, rank]"""
    scale: float


@dataclass(eq=False)
class Adapter:
    name: str
    path: Path
    rank: int
    layers: dict[str, LoraPair]
    """By the wrapped layer's module path (``model.layers.0.self_attn.q_proj``)."""
    users: int = 0
    """Requests that run with it now (pins)."""

    @property
    def nbytes(self) -> int:
        return sum(p.a.numel() * p.a.element_size() + p.b.numel() * p.b.element_size() for p in self.layers.values())


@dataclass
class StackedAdapters:
    """The adapters of a batch, side by side: per layer, ``A`` as [in, ranks] and ``scale * B``
    as [ranks, out], zero blocks where an adapter leaves the layer alone."""

    adapters: tuple[Adapter, ...]
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    offsets: list[int]
    """Where each adapter's rank block starts; the last entry is the total rank."""


@dataclass
class LoraBatch:
    """What the wrapped layers apply during the current forward pass (``current`` None: the base
    model alone)."""

    layers: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Each wrapped layer's (in_features, out_features), by module path."""
    current: StackedAdapters | None = None
    """The adapters of the forward pass under way (set and cleared by :func:`adapter_rows`)."""
    mask: torch.Tensor | None = None
    """[rows, total rank] of the forward pass under way: 1 where a row's adapter's block is."""
    cached: StackedAdapters | None = None
    """The last stacking, kept while batches use the same adapters (dropped when one is evicted)."""

    def stack(self, adapters: tuple[Adapter, ...], dtype: torch.dtype, device: torch.device) -> StackedAdapters:
        cached = self.cached
        if cached is not None and cached.adapters == adapters:
            return cached
        offsets = [0]
        for adapter in adapters:
            offsets.append(offsets[-1] + adapter.rank)
        weights = {}
        for path, (in_features, out_features) in self.layers.items():
            pairs = [adapter.layers.get(path) for adapter in adapters]
            if not any(pairs):
                continue
            a_blocks = [p.a if p else torch.zeros(a.rank, in_features, dtype=dtype, device=device)
                        for p, a in zip(pairs, adapters)]
            b_blocks = [(p.b * p.scale).t() if p else torch.zeros(a.rank, out_features, dtype=dtype, device=device)
                        for p, a in zip(pairs, adapters)]
            weights[path] = (torch.cat(a_blocks).t().contiguous(), torch.cat(b_blocks).contiguous())
        self.cached = StackedAdapters(adapters, weights, offsets)
        return self.cached

    def forget(self, adapter: Adapter) -> None:
        """An evicted adapter: drop the stacking that holds it (a pass under way keeps its own)."""
        cached = self.cached
        if cached is not None and adapter in cached.adapters:
            self.cached = None


class LoraLinear(nn.Module):
    """A base linear layer (plain, packed or quantized) plus the low-rank updates of the adapters
    that the rows of the batch use."""

    def __init__(self, base: nn.Module, path: str, batch: LoraBatch) -> None:
        super().__init__()
        self.base = base
        self.path = path
        self.batch = batch
        self.in_features = base.in_features
        self.out_features = base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        mask, stacked = self.batch.mask, self.batch.current
        if mask is None or stacked is None or self.path not in stacked.weights:
            return y
        a_all, b_all = stacked.weights[self.path]
        out = y.reshape(-1, self.out_features)
        out.addmm_((x.reshape(-1, self.in_features) @ a_all) * mask, b_all)
        return out.view(y.shape)


_installed: weakref.WeakKeyDictionary[nn.Module, LoraBatch] = weakref.WeakKeyDictionary()
"""The adapter state of each model that serves adapters, kept beside the model rather than on it."""


def lora_batch(model: nn.Module) -> LoraBatch | None:
    """The adapter state :func:`install` gave ``model``; None when it serves no adapters."""
    return _installed.get(model)


def install(model: nn.Module) -> LoraBatch:
    """Wrap every targetable linear layer of ``model`` (once); the model then serves adapters."""
    existing = lora_batch(model)
    if existing is not None:
        return existing
    batch = LoraBatch()
    targets = [(name, module) for name, module in model.named_modules()
               if name.rpartition(".")[2] in TARGETABLE and hasattr(module, "in_features")]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, LoraLinear(module, name, batch))
        batch.layers[name] = (module.in_features, module.out_features)
    if not targets:
        raise AdapterError(f"the model has none of the layers LoRA adapters target ({', '.join(TARGETABLE)})")
    _installed[model] = batch
    return batch


@contextmanager
def adapter_rows(model: nn.Module, seqs: Sequence[Any], tokens: Sequence[int]) -> Iterator[None]:
    """For one forward pass over ``seqs`` whose tokens are laid out one after the other,
    ``tokens[i]`` of them for ``seqs[i]`` (a padded row counts its padding): route each
    sequence's rows through its request's adapter. Does nothing for a model without adapters
    or a batch that uses none."""
    batch = lora_batch(model)
    if batch is None:  # (a shard replays steps on views of sequences, which carry no request)
        yield
        return
    per_seq = [getattr(seq.request, "adapter", None) for seq in seqs]
    if not any(per_seq):
        yield
        return
    parameter = next(model.parameters())
    # One order for a set of adapters, whatever the order of the rows, so that the stacking is
    # rebuilt only when the set changes.
    used = tuple(sorted({id(a): a for a in per_seq if a is not None}.values(), key=lambda a: a.name))
    stacked = batch.stack(used, parameter.dtype, parameter.device)
    mask = torch.zeros(sum(tokens), stacked.offsets[-1], dtype=parameter.dtype)
    start = 0
    for adapter, count in zip(per_seq, tokens):
        if adapter is not None:
            block = used.index(adapter)
            mask[start : start + count, stacked.offsets[block] : stacked.offsets[block + 1]] = 1
        start += count
    batch.current, batch.mask = stacked, mask.to(parameter.device)
    try:
        yield
    finally:
        batch.current, batch.mask = None, None
