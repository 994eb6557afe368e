"""tokenmill's own C++ kernels for CPU, compiled on first use with torch's extension builder:
``paged_decode`` (decode rows, any dtype; and ``store_kv``, a step's keys and values into the pool) and
``paged_prefill`` (bfloat16 prompt chunks) and ``cpu_linear`` (bfloat16 linear layers over weights
blocked for it), both where the CPU has AVX512-BF16. Each source is its own extension, built when
first asked for.

The source ships in the package (``csrc/``); the build lands in tokenmill's cache
(``TOKENMILL_CACHE_DIR``: ``kernels/torch-VERSION/NAME``, a volume in a container; or in
``TORCH_EXTENSIONS_DIR`` where that is set, as the CPU image does at build time), so it
compiles once per machine (~30 s on 2 cores) and later starts load it in well under a second.
One process builds at a time, under a lock the kernel drops if the builder dies; torch's own
lock file, which a build killed midway leaves behind and which makes every later start wait
for ever, is removed under it. Without a C++ compiler and ninja the kernels are unavailable and
callers keep their plain PyTorch path; ``--disable-custom-kernels`` or
``TOKENMILL_NATIVE_KERNELS=0`` turns them off.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tokenmill.model.loading import cache_dir

log = logging.getLogger(__name__)

SOURCES = Path(__file__).resolve().parent / "csrc"
BF16_ONLY = ("paged_prefill", "cpu_linear")
"""Kernels that exist only for AVX512-BF16: without it they are not built at all."""
_turned_off: str | None = None


def turn_off(reason: str) -> None:
    """Use no native kernel in this process from now on (``--disable-custom-kernels``)."""
    global _turned_off
    _turned_off = reason


def _compiler_flags(bf16: bool = True, kernel: str = "paged_decode") -> tuple[str, list[str]]:
    """The build's name and flags: vector instructions only where this CPU has them (a
    different CPU gets its own build, never one it cannot run). ``bf16``: AVX512-BF16 too, where
    the CPU has it."""
    capability = torch.backends.cpu.get_cpu_capability()
    name = f"tokenmill_{kernel}_{capability.lower()}"
    flags = ["-O3", "-fopenmp"]
    if capability in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma", "-mf16c"]
    if capability == "AVX512":
        flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
        if bf16 and _has_avx512_bf16():
            flags.append("-mavx512bf16")
            name += "_bf16"
    return name, flags


def _has_avx512_bf16() -> bool:
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(probe and probe())


@functools.cache
def _load(kernel: str = "paged_decode") -> tuple[Any, str | None]:
    if os.environ.get("TOKENMILL_NATIVE_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
        return None, "turned off by TOKENMILL_NATIVE_KERNELS"
    missing = [tool for tool in ("c++", "ninja") if shutil.which(tool) is None]
    if missing:
        return None, f"no {' or '.join(missing)} on PATH to build them"
    try:
        from torch.utils.cpp_extension import load

        def build(bf16: bool) -> Any:
            name, flags = _compiler_flags(bf16, kernel)
            directory = build_directory(name)
            with build_lock(directory):
                return load(name, [str(SOURCES / f"{kernel}.cpp")], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                            verbose=False, build_directory=str(directory))

        if kernel in BF16_ONLY and not _compiler_flags(bf16=True, kernel=kernel)[0].endswith("_bf16"):
            return None, "this CPU has no AVX512-BF16"
        try:
            return build(bf16=True), None
        except Exception:
            if kernel in BF16_ONLY or _compiler_flags(bf16=True) == _compiler_flags(bf16=False):
                raise
            # A compiler without AVX512-BF16 (GCC before 10) still builds every other path.
            log.warning("building the native kernels with AVX512-BF16 failed; building them without it")
            return build(bf16=False), None
    except Exception as error:  # noqa: BLE001 - a failed build means the plain path, said once
        return None, f"building them failed: {type(error).__name__}: {str(error).strip().splitlines()[-1][:300]}"


def build_directory(name: str) -> Path:
    """Where the build named ``name`` lives: ``TORCH_EXTENSIONS_DIR`` where it is set (the CPU image builds
    the kernels into it), else tokenmill's cache, per torch version."""
    chosen = os.environ.get("TORCH_EXTENSIONS_DIR")
    return (Path(chosen) if chosen else cache_dir() / "kernels" / f"torch-{torch.__version__}") / name


@contextlib.contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """Hold ``directory``'s build lock (``flock``: released by the kernel when its holder exits, however it
    exits) and, holding it, remove the baton file of torch's builder, which only a dead build can have left."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / f"{directory.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            stale = directory / "lock"
            if stale.exists():
                log.warning("removing %s, left by a native-kernel build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def native_unavailable_reason() -> str | None:
    """None when the native CPU kernels are built and loaded (building them now if needed)."""
    if _turned_off:
        return f"turned off by {_turned_off}"
    module, reason = _load()
    if reason:
        _warn_once("tokenmill's native CPU kernels are unavailable (%s); attention uses plain PyTorch", reason)
    return reason


_warned: set[str] = set()


def _warn_once(message: str, reason: str) -> None:
    """Log why a kernel is unavailable the first time it is asked for, not at every step that asks."""
    if message % reason not in _warned:
        _warned.add(message % reason)
        log.warning(message, reason)


def _built(kernel: str, unavailable: str) -> Any:
    """The extension built from ``csrc/KERNEL.cpp``; raises ``unavailable``, with the reason, where it is not."""
    module, reason = _load(kernel)
    if module is None:
        raise RuntimeError(f"{unavailable}: {reason}")
    return module


def _bf16_kernel_unavailable(kernel: str, built: str) -> str | None:
    """None when the AVX512-BF16 kernel ``kernel`` is built and loaded (building it now if needed) and its
    ``built`` probe says the build has its vector path; else why not."""
    if _turned_off:
        return f"turned off by {_turned_off}"
    module, reason = _load(kernel)
    if module is not None and not getattr(module, built)():
        reason = "the compiler built it without AVX512-BF16"
    return reason


def prefill_unavailable_reason() -> str | None:
    """None when the bfloat16 prefill kernel is built and loaded (building it now if needed); else why not,
    logged once: bfloat16 prompt chunks then go through SDPA."""
    reason = _bf16_kernel_unavailable("paged_prefill", "bf16_prefill_built")
    if reason:
        _warn_once("tokenmill's bfloat16 prefill kernel is unavailable (%s); prompt chunks in bfloat16 use SDPA",
                   reason)
    return reason


def linear_unavailable_reason() -> str | None:
    """None when the bfloat16 linear kernel is built and loaded (building it now if needed); else why not,
    logged once: bfloat16 linear layers are then packed for oneDNN instead."""
    reason = _bf16_kernel_unavailable("cpu_linear", "bf16_linear_built")
    if reason:
        _warn_once("tokenmill's bfloat16 linear kernel is unavailable (%s); bfloat16 weights are packed for oneDNN",
                   reason)
    return reason


def blocked_linear(x: torch.Tensor, blocked: torch.Tensor, out_features: int,
                   float_output: bool = False) -> torch.Tensor:
    """``x`` (``[rows, in_features]``, contiguous bfloat16) times the weight that :func:`block_weight` laid
    out; returns ``[rows, out_features]``, bfloat16, or float32 with ``float_output``.
    Call only when :func:`linear_unavailable_reason` is None."""
    module = _built("cpu_linear", "the native linear kernel is unavailable")
    return module.blocked_linear(x, blocked, out_features, float_output)


def block_weight(weight: torch.Tensor) -> torch.Tensor:
    """A linear layer's ``[out_features, in_features]`` bfloat16 weight laid out for :func:`blocked_linear`:
    ``[out/16, in/2, 16, 2]``, zero-padded to whole blocks and pairs."""
    rows, columns = weight.shape
    if rows % 16 or columns % 2:
        padded = weight.new_zeros((-(-rows // 16) * 16, -(-columns // 2) * 2))
        padded[:rows, :columns] = weight
        return block_weight(padded)
    # Each pair as one int32: a transpose of [16, in/2] tiles, which torch copies 3x faster than the 4-D permute
    # (0.05 s against 0.17 s for SmolLM2's weights, at every start).
    pairs = weight.contiguous().view(torch.int32).view(rows // 16, 16, columns // 2)
    return pairs.transpose(1, 2).contiguous().view(torch.bfloat16).view(rows // 16, columns // 2, 16, 2)


def paged_prefill(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                  query_starts: torch.Tensor, query_lens: torch.Tensor, context_lens: torch.Tensor,
                  sliding_window: int | None, scale: float, out: torch.Tensor) -> None:
    """Causal attention of bfloat16 prompt chunks over their sequences' blocks, written into ``out``.

    ``query`` and ``out`` ``[tokens, heads, dim]``; caches ``[blocks, block_size, kv_heads, dim]``; per chunk
    (one a row of ``block_tables``), where its queries start in ``query``, how many there are, and its context
    length after them (the queries are its last positions). Head sizes: multiples of 16 up to 256. Rows of
    ``out`` no chunk covers are left as they were. Call only when :func:`prefill_unavailable_reason` is None."""
    module = _built("paged_prefill", "the native prefill kernel is unavailable")
    module.paged_prefill(query, key_cache, value_cache, block_tables, query_starts, query_lens, context_lens,
                         sliding_window or 0, scale, out)


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Write a step's keys and values (``[1, kv_heads, tokens, dim]``, as the model makes them) into their
    ``slots`` (int64, block × block_size + offset) of caches of the same dtype, in one call.
    Call only when :func:`native_unavailable_reason` is None."""
    _built("paged_decode", "the native CPU kernels are unavailable").store_kv(key, value, key_cache, value_cache,
                                                                             slots)


def paged_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, sliding_window: int | None,
                 scale: float) -> torch.Tensor:
    """Attention of one query token per sequence over its blocks: ``query`` ``[seqs, heads, dim]``,
    caches ``[blocks, block_size, kv_heads, dim]``; returns ``[seqs, heads, dim]``.
    Call only when :func:`native_unavailable_reason` is None."""
    module = _built("paged_decode", "the native CPU kernels are unavailable")
    return module.paged_decode(query, key_cache, value_cache, block_tables, context_lens, sliding_window or 0, scale)
