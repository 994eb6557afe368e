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

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tokenmill.model.loading import ModelLoadError

if TYPE_CHECKING:
    from tokenmill.config import Config
    from tokenmill.model.loading import LoadedModel, Stages

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


def install(model: nn.Module) -> LoraBatch:
    """Wrap every targetable linear layer of ``model`` (once); the model then serves adapters."""
    existing = getattr(model, "tokenmill_lora", None)
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
    model.tokenmill_lora = batch  # type: ignore[assignment]
    return batch


@contextmanager
def adapter_rows(model: nn.Module, seqs: Sequence[Any], tokens: Sequence[int]) -> Iterator[None]:
    """For one forward pass over ``seqs`` whose tokens are laid out one after the other,
    ``tokens[i]`` of them for ``seqs[i]`` (a padded row counts its padding): route each
    sequence's rows through its request's adapter. Does nothing for a model without adapters
    or a batch that uses none."""
    batch: LoraBatch | None = getattr(model, "tokenmill_lora", None)
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


def read_peft_adapter(name: str, path: Path, layers: dict[str, tuple[int, int]], max_rank: int,
                      dtype: torch.dtype, device: torch.device) -> Adapter:
    """A PEFT LoRA checkpoint (``adapter_config.json`` + ``adapter_model.safetensors``) as an
    :class:`Adapter` for a base model whose wrapped layers have the shapes in ``layers``."""
    from safetensors.torch import load_file

    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise AdapterError(f"adapter {name!r}: {path} has no adapter_config.json and adapter_model.safetensors "
                           "(a PEFT LoRA checkpoint)")
    try:
        config = json.loads(config_file.read_text())
        alpha, rank = float(config.get("lora_alpha", 8)), int(config["r"])
    except (ValueError, KeyError, TypeError) as error:
        raise AdapterError(f"adapter {name!r}: adapter_config.json is not a LoRA config ({type(error).__name__}: "
                           f"{error})") from None
    refusal = unsupported_peft_option(config)
    if refusal:
        raise AdapterError(f"adapter {name!r}: {refusal}")
    scale = alpha / (rank ** 0.5 if config.get("use_rslora") else rank)
    tensors = load_file(str(weights_file))
    pairs: dict[str, LoraPair] = {}
    others = [key for key in tensors if not key.endswith((".lora_A.weight", ".lora_B.weight"))]
    if others:
        raise AdapterError(f"adapter {name!r} also changes {others[0].removeprefix(PEFT_PREFIX)}: only LoRA on the "
                           f"linear layers {', '.join(TARGETABLE)} is served")
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
        b = tensors.get(key.replace(".lora_A.weight", ".lora_B.weight"))
        if module not in layers or b is None:
            raise AdapterError(f"adapter {name!r} adapts {module}, which is not one of this base model's layers "
                               f"that adapters may target ({', '.join(TARGETABLE)})")
        in_features, out_features = layers[module]
        if a.shape[1] != in_features or b.shape[0] != out_features or a.shape[0] != b.shape[1]:
            raise AdapterError(f"adapter {name!r}: {module} has shapes A {tuple(a.shape)}, B {tuple(b.shape)}, but the "
                               f"base layer is {in_features} -> {out_features}: it was trained for another base model")
        if a.shape[0] != rank:
            raise AdapterError(f"adapter {name!r} has rank {a.shape[0]} on {module} but r={rank} in its config")
        if a.shape[0] > max_rank:
            raise AdapterError(f"adapter {name!r} has rank {a.shape[0]} on {module}, above --max-lora-rank {max_rank}")
        pairs[module] = LoraPair(a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous(), scale)
    if not pairs:
        raise AdapterError(f"adapter {name!r}: {weights_file.name} holds no LoRA weights")
    return Adapter(name, path, rank, pairs)


def unsupported_peft_option(config: dict[str, Any]) -> str | None:
    if config.get("peft_type", "LORA") != "LORA":
        return f"it is a {config.get('peft_type')} adapter; only LoRA is served"
    for option in ("use_dora", "fan_in_fan_out"):
        if config.get(option):
            return f"{option} is not supported"
    if config.get("bias", "none") != "none":
        return "adapters that train biases are not supported"
    if config.get("modules_to_save"):
        return "modules_to_save (fully trained layers) are not supported"
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        return "per-layer rank_pattern / alpha_pattern are not supported"
    return None


def locate(source: str) -> Path:
    """A local adapter directory, or a hub id's snapshot already in the local Hugging Face cache."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, local_files_only=True))
    except Exception as error:  # noqa: BLE001 - any failure means: not available offline
        raise AdapterError(f"adapter {source!r} is not a local directory and not in the local Hugging Face cache "
                           f"({type(error).__name__})") from None


@dataclass
class CacheStats:
    loads: int = 0
    evictions: int = 0


class AdapterCache:
    """Every adapter the server knows (by name, with where to load it from) and the at most
    ``limit`` of them in memory. Thread-safe. Reading an adapter from disk happens outside the
    lock (on the tokenizer thread); pinning is quick and never reads."""

    def __init__(self, batch: LoraBatch, limit: int, max_rank: int, dtype: torch.dtype, device: torch.device,
                 base_model_id: str | None = None) -> None:
        self.batch = batch
        self.limit = limit
        self.max_rank = max_rank
        self.dtype, self.device = dtype, device
        self.base_model_id = base_model_id
        self.sources: dict[str, Path] = {}
        self.loaded: OrderedDict[str, Adapter] = OrderedDict()
        """Least recently used first."""
        self.stats = CacheStats()
        self.lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        return sorted(self.sources)

    def register(self, name: str, source: str) -> Adapter:
        """Learn an adapter and load it now, so that a bad one is refused at once (AdapterError) and
        one that finds no free slot is not learnt (AdapterBusy). Later it may be evicted and is then
        reloaded on demand."""
        if not name or "=" in name or "," in name or name == self.base_model_id:
            raise AdapterError(f"adapter id {name!r} must be a non-empty name without '=' or ',', other than "
                               "the base model's id")
        path = locate(source)
        with self.lock:
            if name in self.sources and self.sources[name] != path:
                raise AdapterError(f"adapter {name!r} is already loaded from {self.sources[name]}")
        adapter = self._read(name, path)
        with self.lock:
            adapter = self._insert(name, adapter)
            self.sources[name] = path
        log.info("adapter %s: rank %d on %d layers from %s", name, adapter.rank, len(adapter.layers), path)
        return adapter

    def load(self, name: str) -> None:
        """Make ``name`` resident (reading it if it was evicted); AdapterBusy when no slot is free."""
        with self.lock:
            if name in self.loaded:
                return
            if name not in self.sources:
                raise AdapterError(f"unknown adapter {name!r}")
            path = self.sources[name]
        adapter = self._read(name, path)
        with self.lock:
            self._insert(name, adapter)

    def pin(self, name: str) -> Adapter | None:
        """Pin a resident adapter for a request (None if it is not resident: :meth:`load` it first).
        Give it back with :meth:`release`."""
        with self.lock:
            adapter = self.loaded.get(name)
            if adapter is not None:
                self.loaded.move_to_end(name)
                adapter.users += 1
            return adapter

    def release(self, adapter: Adapter) -> None:
        with self.lock:
            adapter.users -= 1

    def _read(self, name: str, path: Path) -> Adapter:
        return read_peft_adapter(name, path, self.batch.layers, self.max_rank, self.dtype, self.device)

    def _insert(self, name: str, adapter: Adapter) -> Adapter:
        """Under the lock: keep ``adapter`` (or the copy another thread loaded meanwhile)."""
        if name in self.loaded:
            return self.loaded[name]
        while len(self.loaded) >= self.limit:
            idle = next((key for key, held in self.loaded.items() if held.users == 0), None)
            if idle is None:
                raise AdapterBusy(f"all {self.limit} adapter slots (--lora-cache-limit) are in use by running requests")
            self.batch.forget(self.loaded.pop(idle))
            self.stats.evictions += 1
            log.info("adapter %s evicted (least recently used)", idle)
        self.loaded[name] = adapter
        self.stats.loads += 1
        return adapter

    def usage(self) -> dict[str, Any]:
        with self.lock:
            return {"known": len(self.sources), "loaded": list(self.loaded), "limit": self.limit,
                    "bytes": sum(a.nbytes for a in self.loaded.values()), "loads": self.stats.loads,
                    "evictions": self.stats.evictions}


def load_adapters(config: Config, loaded: LoadedModel, stages: Stages) -> AdapterCache:
    """Wrap the model's layers for LoRA and load the adapters --lora-adapters names."""
    named = config.named_adapters()

    def load() -> AdapterCache:
        try:
            cache = AdapterCache(install(loaded.model), config.adapter_slots, config.max_lora_rank,
                                 loaded.dtype, loaded.device, base_model_id=loaded.model_id)
            for name, source in named:
                cache.register(name, source)
        except (AdapterError, AdapterBusy) as error:
            raise ModelLoadError(str(error)) from None
        return cache

    return stages.run("loading adapters", load, detail=", ".join(name for name, _ in named) or "none yet")
