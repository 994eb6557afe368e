"""How much KV memory a model needs per position, from its transformers config, and how many
positions the KV pool gets in the memory left after loading."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.model import collector
from tokenmill.model.cgroup import container_memory

if TYPE_CHECKING:
    from tokenmill.config import Config
    from tokenmill.model.loading import LoadedModel

log = logging.getLogger(__name__)


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


def available_memory_bytes() -> int:
    """RAM this process may still take: the smaller of what the machine has available (Linux
    MemAvailable; total physical memory elsewhere) and what its container's memory limit leaves."""
    machine = host_available_bytes()
    container = container_memory()
    if container is None or container.available >= machine:
        return machine
    log.info("the container's memory limit binds: %.0f MiB of %.0f MiB left (%s), the host has %.0f MiB",
             container.available / 2**20, container.limit / 2**20, container.source, machine / 2**20)
    return container.available


def host_available_bytes() -> int:
    """RAM the machine has available now (Linux MemAvailable), or total physical memory elsewhere."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def kv_dtype(config: Config, loaded: LoadedModel) -> torch.dtype:
    """The KV pool's dtype: the model's, or float8 with ``--kv-cache-dtype fp8_e4m3fn``."""
    return torch.float8_e4m3fn if config.kv_cache_dtype == "fp8_e4m3fn" else loaded.dtype


def kv_pool_tokens(config: Config, model_config: Any, loaded: LoadedModel) -> int:
    """How many positions the KV pool holds when --max-batch-total-tokens is not given:
    the memory left after loading, within the configured fraction."""
    if loaded.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(loaded.device)
        budget = min(free, config.cuda_memory_fraction * total - (total - free)) * 0.9
    else:  # the ranks of --num-shard share this machine's RAM, each with a pool this size
        budget = available_memory_bytes() * config.kv_memory_fraction / config.num_shard
    per_token = bytes_per_token(model_config, kv_dtype(config, loaded))
    context = min(getattr(model_config, "max_position_embeddings", None) or 4096, 4096)
    tokens = int(max(0, budget) // per_token)
    ceiling = 64 * (config.max_total_tokens or context)  # enough for 64 full-length sequences
    log.info("KV pool: %d positions (%.0f MiB of %.0f MiB allowed)", min(tokens, ceiling),
             min(tokens, ceiling) * per_token / 2**20, budget / 2**20)
    return min(tokens, ceiling)


ONEDNN_PRIMITIVE_CACHE = 64
"""oneDNN's cache of compiled matmul kernels, one per shape (a step's token count times each weight's shape),
~0.3 MB each: its default of 1024 holds hundreds of MB once a server has seen that many step sizes."""

IDEEP_COMPUTATION_CACHE = 64
"""The cache of ideep (oneDNN's C++ layer in torch) in front of it, read from ``LRU_CACHE_CAPACITY``: one
entry per packed linear layer's call shape, ~0.25 MB each, 1024 by default. Both at their defaults, a server
kept ~350 MB more after seeing a few hundred step sizes (`python -m bench soak`); at 64 each, a step size
seen again is still found (a decode batch keeps its size for many steps)."""


def bound_native_caches() -> None:
    """Cap oneDNN's and ideep's kernel caches (unless ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` or
    ``LRU_CACHE_CAPACITY`` is set): read when they are first used, so call this before the model runs."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_PRIMITIVE_CACHE))
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(IDEEP_COMPUTATION_CACHE))


def trim_heap() -> bool:
    """Give the C heap's free pages back to the operating system (glibc's ``malloc_trim``); False where
    there is no glibc. Tensors of ever-changing sizes (each step's batch) leave freed memory scattered
    over malloc's arenas, which glibc keeps: without a trim now and then a server's resident memory
    creeps up although nothing leaks."""
    libc = _c_library()
    if not libc:
        return False
    libc.malloc_trim(0)
    return True


MADV_DONTNEED = 4  # Linux's value


def release_pages(tensor: torch.Tensor) -> int:
    """Give the whole memory pages inside a CPU ``tensor`` back to the operating system (``madvise``
    ``MADV_DONTNEED``), keeping the tensor: its contents are lost, and those pages read as zeros and take
    memory again only once written. How many bytes; 0 off Linux or for a tensor on another device."""
    libc = _c_library()
    if not libc or tensor.device.type != "cpu" or not tensor.is_contiguous() or not hasattr(libc, "madvise"):
        return 0
    pages = interior_pages(tensor)
    if pages is None or libc.madvise(pages[0], pages[1], MADV_DONTNEED) != 0:
        return 0
    return pages[1]


def interior_pages(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The address and length of the whole memory pages inside ``tensor``'s memory (None for less than a page)."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr()
    first = -(-start // page) * page
    last = (start + tensor.nbytes) // page * page
    return (first, last - first) if last > first else None


def _c_library() -> Any:
    global _libc
    if _libc is None:
        import ctypes
        import ctypes.util

        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _libc = False
        with contextlib.suppress(AttributeError):  # release_pages checks it is there
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _libc


_libc: Any = None


def freeze_heap(collect: bool = True) -> int:
    """Collect (unless ``collect`` is False), then move every Python object alive now out of the garbage
    collector's sight (``gc.freeze``): call once the start (or the background compile) has built what lives
    as long as the server. The model, the tokenizer and a compile leave hundreds of thousands of objects, and
    each full collection walked them all, with every thread waiting (0.4 to 0.8 s on SmolLM2 while serving);
    later ones walk only what serving made. Returns how many objects are frozen."""
    if collect:
        gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def freeze_start_heap() -> int:
    """Freeze what a start built (:func:`freeze_heap`, not collected first: the young collections that ran
    meanwhile left about 500 cyclic objects on SmolLM2, and a full collection would walk all 450,000) and let full
    collections run again where ``tokenmill launch`` held them back (:mod:`tokenmill.model.collector`). Returns how
    many objects are frozen."""
    frozen = freeze_heap(collect=False)
    collector.release_full_collections()
    return frozen
