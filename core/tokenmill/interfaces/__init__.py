"""The contracts plugin implementations fulfil, one per plugin kind.

Each implementation has a ``name`` (what the flag selects), a one-line
``description`` and ``unavailable_reason()``, which returns None when the
implementation can run on this machine, else why not ("needs CUDA").

One module per kind: :mod:`~tokenmill.interfaces.base` (:class:`Implementation`),
:mod:`~tokenmill.interfaces.quantizer`, :mod:`~tokenmill.interfaces.attention`,
:mod:`~tokenmill.interfaces.kv`, :mod:`~tokenmill.interfaces.scheduler` and
:mod:`~tokenmill.interfaces.backend`; every name is importable from here.
"""

from tokenmill.interfaces.attention import AttentionKernel, PagedStep
from tokenmill.interfaces.backend import Backend, BackendRunner, EngineSetup, PrefillOutput, StepOutput
from tokenmill.interfaces.base import Implementation
from tokenmill.interfaces.kv import (
    NO_HIT,
    BlockPool,
    CachingBlockPool,
    KVAllocator,
    PaddedKVCache,
    PrefixHit,
    PrefixLookup,
    blocks_for,
    padded_block_tables,
)
from tokenmill.interfaces.quantizer import Quantizer
from tokenmill.interfaces.scheduler import BatchLimits, Preemption, Scheduler, SchedulerQueue, StepBudget

__all__ = [
    "NO_HIT",
    "AttentionKernel",
    "Backend",
    "BackendRunner",
    "BatchLimits",
    "BlockPool",
    "CachingBlockPool",
    "EngineSetup",
    "Implementation",
    "KVAllocator",
    "PaddedKVCache",
    "PagedStep",
    "Preemption",
    "PrefillOutput",
    "PrefixHit",
    "PrefixLookup",
    "Quantizer",
    "Scheduler",
    "SchedulerQueue",
    "StepBudget",
    "StepOutput",
    "blocks_for",
    "padded_block_tables",
]
