"""LoRA adapters as files and in memory: reading a PEFT checkpoint into an :class:`Adapter`
(refusing one that does not fit the base model), and the :class:`AdapterCache` that knows every
adapter by name and keeps at most ``--lora-cache-limit`` of them in memory, least recently used
first out; a request pins its adapter while it runs, and a pinned adapter is never evicted.

It also re-exports the layer side (:mod:`tokenmill.model.lora`: ``install``, ``adapter_rows``, ``Adapter``,
...), as hooks.md told plugin authors it does."""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.model import hub
from tokenmill.model.loading import ModelLoadError
from tokenmill.model.lora import (  # the layer side too: hooks.md names it here
    PEFT_PREFIX,
    TARGETABLE,
    Adapter,
    AdapterBusy,
    AdapterError,
    LoraBatch,
    LoraLinear,
    LoraPair,
    StackedAdapters,
    adapter_rows,
    install,
    lora_batch,
)

if TYPE_CHECKING:
    from tokenmill.config import Config
    from tokenmill.model.loading import LoadedModel, Stages

log = logging.getLogger("tokenmill.model.lora")


def read_peft_adapter(name: str, path: Path, layers: dict[str, tuple[int, int]], max_rank: int,
                      dtype: torch.dtype, device: torch.device) -> Adapter:
    """A PEFT LoRA checkpoint (``adapter_config.json`` + ``adapter_model.safetensors``) as an
    :class:`Adapter` for a base model whose wrapped layers have the shapes in ``layers``."""
    from safetensors.torch import load_file

    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        log.warning("adapter %s: %s has no adapter_config.json and adapter_model.safetensors", name, path)
        raise AdapterError(f"adapter {name!r}: its directory has no adapter_config.json and adapter_model.safetensors "
                           "(a PEFT LoRA checkpoint)")
    try:
        config = json.loads(config_file.read_text())
        alpha, rank = float(config.get("lora_alpha", 8)), int(config["r"])
    except (ValueError, KeyError, TypeError) as error:
        raise AdapterError(f"adapter {name!r}: adapter_config.json is not a LoRA config ({type(error).__name__}: "
                           f"{error})") from None
    refusal = peft_unavailable_reason(config)
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


def peft_unavailable_reason(config: dict[str, Any]) -> str | None:
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


MAX_ADAPTER_DOWNLOAD_BYTES = 1 << 30
"""The most an adapter fetched from the hub may hold (a LoRA adapter is megabytes; 1 GiB is rank 256 of
a 70B model's attention)."""


def locate(source: str, hub_cache: str | None = None) -> Path:
    """A local adapter directory, or a hub id's snapshot: downloaded (adapter_config.json, the weights;
    at most :data:`MAX_ADAPTER_DOWNLOAD_BYTES`) into ``hub_cache`` (None: the hub client's default), or
    only from the local cache with HF_HUB_OFFLINE=1."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if not hub.is_repo_id(source):
        raise AdapterError(f"adapter {source!r} is not a local directory (no such path) and no hub id (org/name)")
    try:
        return hub.snapshot(source, None, hub_cache, required="adapter_config.json",
                            max_bytes=MAX_ADAPTER_DOWNLOAD_BYTES)
    except hub.HubError as error:
        raise AdapterError(f"adapter {source!r}: {error}") from None


@dataclass
class CacheStats:
    loads: int = 0
    evictions: int = 0


class AdapterCache:
    """Every adapter the server knows (by name, with where to load it from) and the at most
    ``limit`` of them in memory. Thread-safe. Reading an adapter from disk happens outside the
    lock (on the tokenizer thread); pinning is quick and never reads."""

    def __init__(self, batch: LoraBatch, limit: int, max_rank: int, dtype: torch.dtype, device: torch.device,
                 base_model_id: str | None = None, hub_cache: str | None = None,
                 served_model_name: str | None = None) -> None:
        self.batch = batch
        self.hub_cache = hub_cache
        """Where adapters named by hub id are downloaded (None: the hub client's default cache)."""
        self.limit = limit
        self.max_rank = max_rank
        self.dtype, self.device = dtype, device
        self.base_model_id = base_model_id
        self.model_names = frozenset(name for name in (base_model_id, served_model_name) if name)
        """The names that select the base model: no adapter may take one (every client naming it would get it)."""
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
        refusal = adapter_id_refusal(name, self.model_names)
        if refusal:
            raise AdapterError(refusal)
        path = locate(source, self.hub_cache)
        with self.lock:
            if name in self.sources and self.sources[name] != path:
                raise AdapterError(f"adapter {name!r} is already loaded from another directory")
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


def adapter_id_refusal(name: str, model_names: frozenset[str]) -> str | None:
    """Why ``name`` cannot be an adapter's id, or None: it must be a non-empty printable name without '=',
    ',' or a path step up ('..'), and not a name the base model is served under."""
    if not name or "=" in name or "," in name or not name.isprintable() or ".." in name.split("/"):
        return (f"adapter id {name!r} must be a non-empty printable name without '=', ',', control characters "
                "or '..' steps")
    if name in model_names:
        return f"adapter id {name!r} is a name the base model is served under"
    return None


def load_adapters(config: Config, loaded: LoadedModel, stages: Stages) -> AdapterCache:
    """Wrap the model's layers for LoRA and load the adapters --lora-adapters names."""
    named = config.named_adapters()

    def load() -> AdapterCache:
        try:
            cache = AdapterCache(install(loaded.model), config.adapter_slots, config.max_lora_rank,
                                 loaded.dtype, loaded.device, base_model_id=loaded.model_id,
                                 hub_cache=getattr(config, "huggingface_hub_cache", None),
                                 served_model_name=config.served_model_name)
            for name, source in named:
                cache.register(name, source)
        except (AdapterError, AdapterBusy) as error:
            raise ModelLoadError(str(error)) from None
        return cache

    return stages.run("loading adapters", load, detail=", ".join(name for name, _ in named) or "none yet")


__all__ = ["PEFT_PREFIX", "TARGETABLE", "Adapter", "AdapterBusy", "AdapterCache", "AdapterError", "CacheStats",
           "LoraBatch", "LoraLinear", "LoraPair", "StackedAdapters", "adapter_rows", "install", "load_adapters",
           "locate", "lora_batch", "peft_unavailable_reason", "read_peft_adapter"]
