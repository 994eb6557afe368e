"""The server's care of its process heap: what it frees, what it keeps out of the garbage collector's walks."""

from __future__ import annotations

import gc
import weakref

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
        assert frozen == gc.get_freeze_count() > 0
        assert not any(tracked is alive for tracked in gc.get_objects())
    finally:
        gc.unfreeze()
    assert any(tracked is alive for tracked in gc.get_objects())
