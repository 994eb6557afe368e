"""The weights put out of memory while the server sleeps, in place.

Each large CPU tensor of the model (parameters, buffers, and tensors that layers hold, as packed weights are)
has its whole memory pages written once to a file, and the file is mapped privately over those pages: the
tensors keep their addresses, so every holder (packed layers, the compiled forward, the KV pool's views) stays
valid, and the memory they took goes back to the system. When the forward next reads them, the pages come back
from the page cache (or the disk). At the next sleep the pages, now the file's, are simply dropped again. The
file is unlinked at once: it lives as long as its mappings, and leaves nothing behind when the process ends.

Weights must not be written while offloaded: a later sleep would bring back the values written at the first.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import tempfile
import weakref
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from tokenmill.model import kv_memory

log = logging.getLogger(__name__)

MIN_BYTES = 1 << 20
"""Tensors smaller than this stay in memory (norms, biases: a few pages each)."""


class WeightFile:
    """One model's weights written out (see the module's docstring). It holds the tensors it mapped, and when it
    is collected (the model is unloaded) it puts anonymous memory holding their bytes back under them, so that
    their memory goes back to the allocator as it came."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        handle, path = tempfile.mkstemp(prefix="weights-", dir=directory)
        os.unlink(path)  # the mappings keep it; nothing is left behind
        self.fd = handle
        self.size = 0
        self.mapped: dict[int, tuple[torch.Tensor, int, int, int]] = {}
        """Each tensor whose pages are the file's, by id: the tensor, its pages' address and length, and their
        offset in the file."""
        self._restore = weakref.finalize(self, restore, handle, self.mapped)
        self._restore.atexit = False  # at exit the system takes it all back; a forward may still be running

    def put_away(self, model: nn.Module) -> int:
        """Give the memory of ``model``'s large CPU tensors back to the system; how many bytes."""
        libc = c_library()
        if libc is None:
            return 0
        released = 0
        for tensor in model_tensors(model):
            pages = kv_memory.interior_pages(tensor)
            if pages is None:
                continue
            known = self.mapped.get(id(tensor))
            if known is not None and known[0] is tensor and known[1:3] == pages:
                released += pages[1] if libc.madvise(pages[0], pages[1], kv_memory.MADV_DONTNEED) == 0 else 0
            elif self._map(libc, *pages):
                self.mapped[id(tensor)] = tensor, *pages, self.size - pages[1]
                released += pages[1]
        return released

    def _map(self, libc: ctypes.CDLL, address: int, length: int) -> bool:
        """Write the pages at ``address`` to the file's end and map them from there."""
        offset = self.size
        view = memoryview((ctypes.c_char * length).from_address(address)).cast("B")
        written = 0
        while written < length:
            written += os.pwrite(self.fd, view[written:], offset + written)
        self.size += length
        placed = libc.mmap(address, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | MAP_FIXED,
                           self.fd, offset)
        if placed != address:
            log.warning("could not map the weights' pages at %#x back from the file", address)
            return False
        return True

    def close(self) -> None:
        """Put the tensors' memory back as it was and close the file (done when this is collected too)."""
        self._restore()


MAP_FIXED = 0x10  # Linux's values
MAP_ANONYMOUS = 0x20


def restore(fd: int, mapped: dict[int, tuple[torch.Tensor, int, int, int]]) -> None:
    """Anonymous memory holding the file's bytes under every mapped tensor, then the file closed: the tensors'
    memory is the allocator's again, not the file's."""
    libc = c_library()
    for _, address, length, offset in mapped.values():
        placed = libc.mmap(address, length, mmap.PROT_READ | mmap.PROT_WRITE,
                           mmap.MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) if libc is not None else None
        if placed != address:
            log.error("the weights' pages at %#x could not be given back their memory", address)
            continue
        view = memoryview((ctypes.c_char * length).from_address(address)).cast("B")
        read = 0
        while read < length:
            read += os.preadv(fd, [view[read:]], offset + read)
    mapped.clear()
    os.close(fd)


def c_library() -> ctypes.CDLL | None:
    """libc with ``mmap`` and ``madvise`` typed, or None off Linux."""
    libc = kv_memory._c_library()
    if not libc or not hasattr(libc, "mmap") or not hasattr(libc, "madvise"):
        return None
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    return libc


def model_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    """Every dense CPU parameter and buffer of ``model`` of at least :data:`MIN_BYTES`, each once (oneDNN's
    opaque packed weights stay in memory)."""
    seen: set[int] = set()
    for module in model.modules():
        for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            if (tensor.device.type == "cpu" and tensor.is_contiguous() and not tensor.is_sparse
                    and tensor.layout == torch.strided and tensor.nbytes >= MIN_BYTES
                    and tensor.data_ptr() not in seen):
                seen.add(tensor.data_ptr())
                yield tensor
