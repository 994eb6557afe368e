"""The server's care of its process heap: what it frees, what it keeps out of the garbage collector's walks."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref

import pytest
import torch

from tokenmill.model import kv_memory


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def test_freezing_the_heap_collects_garbage_first_then_hides_what_is_alive_from_later_collections() -> None:
    garbage_a, garbage_b = Node(), Node()
    garbage_a.other, garbage_b.other = garbage_b, garbage_a  # a cycle: only a collection frees it
    gone = weakref.ref(garbage_a)
    del garbage_a, garbage_b
    alive = Node()
    try:
        frozen = kv_memory.freeze_heap()
        assert gone() is None
        # Frozen objects that another thread (an earlier test's server) lets go of leave the count meanwhile.
        assert 0 < gc.get_freeze_count() <= frozen
        assert not any(tracked is alive for tracked in gc.get_objects())
    finally:
        gc.unfreeze()
    assert any(tracked is alive for tracked in gc.get_objects())


MATMULS_OF_MANY_SIZES = """
import os, sys
import torch
from tokenmill.model import kv_memory

kv_memory.bound_native_caches()
print(os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"], os.environ["LRU_CACHE_CAPACITY"])

def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

weights = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(out, 576), None) for out in (1536, 576)]
torch.ops.mkldnn._linear_pointwise(torch.randn(1, 576), weights[0], None, "none", [], "")
kv_memory.trim_heap()
before = rss_mib()
for rows in range(1, 301):  # a server's steps: every token count from 1 to 300
    for weight in weights:
        torch.ops.mkldnn._linear_pointwise(torch.randn(rows, 576), weight, None, "none", [], "")
kv_memory.trim_heap()
print(rss_mib() - before)
"""


def matmul_cache_growth_mib(environment: dict[str, str]) -> tuple[str, float]:
    """The caps a fresh process runs with, and how much its memory grew over matmuls of 300 sizes."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    done = subprocess.run([sys.executable, "-c", MATMULS_OF_MANY_SIZES], env={**env, **environment},
                          capture_output=True, text=True, timeout=300, check=True)
    caps, growth = done.stdout.strip().splitlines()[-2:]
    return caps, float(growth)


@pytest.mark.slow
@pytest.mark.skipif(not torch.backends.mkldnn.is_available() or not sys.platform.startswith("linux"),
                    reason="oneDNN's caches, measured through Linux's /proc")
def test_the_matmul_caches_are_capped_so_new_step_sizes_do_not_grow_memory_for_ever() -> None:
    capped_caps, capped = matmul_cache_growth_mib({})
    default_caps, uncapped = matmul_cache_growth_mib({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024",
                                                      "LRU_CACHE_CAPACITY": "1024"})
    assert capped_caps == f"{kv_memory.ONEDNN_PRIMITIVE_CACHE} {kv_memory.IDEEP_COMPUTATION_CACHE}"
    assert default_caps == "1024 1024"  # an operator's own setting is kept
    assert capped < uncapped / 2, (capped, uncapped)
