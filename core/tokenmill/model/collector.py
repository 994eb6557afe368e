"""Python's garbage collector while a server starts: full collections held back until the start ends.

A start makes some 450,000 objects that live as long as the server (modules, the model, the tokenizer).
CPython begins a full collection, which walks every tracked object, whenever the objects that survived the
young collections grew by a quarter: six in the imports alone of SmolLM2's warm start, 0.85 s that found next
to nothing. ``tokenmill launch`` holds them back from its first line (:func:`hold_full_collections`); young
collections go on and free what the start drops at once (about 500 cyclic objects are left at its end, against
10,000 with no collection at all). The served model's start ends by freezing what it built and letting full
collections run again (:func:`tokenmill.model.kv_memory.freeze_start_heap`). Nothing here imports torch: the
launcher calls it before the imports it speeds up.
"""

from __future__ import annotations

import gc

HELD_THRESHOLD = 1 << 30
"""Young collections before a full one while held: never, in practice."""

_thresholds: tuple[int, int, int] | None = None
"""The collector's thresholds from before :func:`hold_full_collections`; None while not held."""


def hold_full_collections() -> None:
    """No full collection until :func:`release_full_collections` (young ones go on)."""
    global _thresholds
    if _thresholds is None:
        _thresholds = gc.get_threshold()
        gc.set_threshold(_thresholds[0], _thresholds[1], HELD_THRESHOLD)


def release_full_collections() -> None:
    """The thresholds from before :func:`hold_full_collections` again (nothing when they were not held)."""
    global _thresholds
    if _thresholds is not None:
        gc.set_threshold(*_thresholds)
        _thresholds = None
