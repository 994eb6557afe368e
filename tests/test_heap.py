"""The server's care of its process heap: what it frees, what it keeps out of the garbage collector's walks."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref
from collections.abc import Iterator

import pytest
import torch

from tokenmill.model import collector, kv_memory


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


def full_collections_held() -> bool:
    return gc.get_threshold()[2] == collector.HELD_THRESHOLD


@pytest.fixture
def held_full_collections() -> Iterator[None]:
    collector.hold_full_collections()
    try:
        yield
    finally:
        collector.release_full_collections()
        gc.unfreeze()


def test_full_collections_are_held_back_then_released_to_the_thresholds_they_had() -> None:
    before = gc.get_threshold()
    collector.hold_full_collections()
    collector.hold_full_collections()  # twice: still released to the first thresholds
    try:
        assert full_collections_held() and gc.get_threshold()[:2] == before[:2] and gc.isenabled()
    finally:
        collector.release_full_collections()
    assert gc.get_threshold() == before
    collector.release_full_collections()  # not held: nothing changes
    assert gc.get_threshold() == before


def test_young_collections_go_on_freeing_garbage_while_full_ones_are_held(held_full_collections: None) -> None:
    garbage_a, garbage_b = Node(), Node()
    garbage_a.other, garbage_b.other = garbage_b, garbage_a
    gone = weakref.ref(garbage_a)
    del garbage_a, garbage_b
    made = [[] for _ in range(20_000)]  # CPython collects the young generation every 700 tracked objects made
    assert gone() is None
    del made


def test_ending_a_start_freezes_what_it_built_and_releases_full_collections(held_full_collections: None) -> None:
    alive = Node()
    assert kv_memory.freeze_start_heap() > 0
    assert not full_collections_held()
    assert not any(tracked is alive for tracked in gc.get_objects())


LAUNCH_REPORTING_THE_COLLECTOR = """
import gc
import tokenmill.cli.launch
from tokenmill.model import collector
from tokenmill.cli import main

tokenmill.cli.launch.launch = lambda argv: print(gc.get_threshold()[2] == collector.HELD_THRESHOLD) or 0
main(["launch"])
"""


def test_a_launch_holds_full_collections_back_from_its_first_line() -> None:
    done = subprocess.run([sys.executable, "-c", LAUNCH_REPORTING_THE_COLLECTOR], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.strip() == "True"


@pytest.mark.parametrize(("flags", "worker_holds_them"), [
    ([], True),  # until its model's start ends (ServerState's load)
    (["--model-id", "a=/models/a", "--model-id", "b=/models/b"], False),  # a router loads models later
])
def test_gunicorn_master_releases_full_collections_before_forking_and_a_model_worker_holds_them_again(
        flags: list[str], worker_holds_them: bool, held_full_collections: None) -> None:
    from tokenmill.config import parse_config
    from tokenmill.http.serve import gunicorn_options

    options = gunicorn_options(parse_config(flags))
    options["pre_fork"](None, None)
    assert not full_collections_held()
    options["post_fork"](None, None)
    assert full_collections_held() == worker_holds_them


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
