"""The contracts plugin implementations fulfil, one per plugin kind.

Each implementation has a ``name`` (what the flag selects), a one-line
``description`` and ``unavailable_reason()``, which returns None when the
implementation can run on this machine, else why not ("needs CUDA").

One module per kind: :mod:`~tokenmill.interfaces.base` (:class:`Implementation`),
:mod:`~tokenmill.interfaces.quantizer`, :mod:`~tokenmill.interfaces.attention`,
:mod:`~tokenmill.interfaces.kv`, :mod:`~tokenmill.interfaces.scheduler`,
:mod:`~tokenmill.interfaces.backend` and :mod:`~tokenmill.interfaces.parsers`; every name is importable from here.
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
from tokenmill.interfaces.parsers import (
    FunctionTool,
    ParsedCall,
    ParsedOutput,
    ReasonedOutput,
    ReasoningParser,
    ToolParser,
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
    "FunctionTool",
    "Implementation",
    "KVAllocator",
    "PaddedKVCache",
    "PagedStep",
    "ParsedCall",
    "ParsedOutput",
    "Preemption",
    "PrefillOutput",
    "PrefixHit",
    "PrefixLookup",
    "Quantizer",
    "ReasonedOutput",
    "ReasoningParser",
    "Scheduler",
    "SchedulerQueue",
    "StepBudget",
    "StepOutput",
    "ToolParser",
    "blocks_for",
    "padded_block_tables",
]
