"""The contracts plugin implementations fulfil, one per plugin kind.

Each implementation has a ``name`` (what the flag selects), a one-line
``description`` and ``unavailable_reason()``, which returns None when the
implementation can run on this machine, else why not ("needs CUDA").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from tokenmill.sequence import Sequence


class Implementation:
    """Base for every plugin implementation."""

    kind: str = ""
    name: str = ""
    description: str = ""

    def unavailable_reason(self) -> str | None:
        """None when this implementation can run here, else the reason it cannot."""
        return None


class AttentionKernel(Implementation):
    """An attention implementation the model's layers call."""

    kind = "attention"
    transformers_name: str = ""
    """The ``attn_implementation`` value transformers knows this kernel by."""


@runtime_checkable
class PaddedKVCache(Protocol):
    """KV storage for a left-padded batch: rows are sequences, columns are positions."""

    def new_cache(self, model_config: Any) -> Any: ...
    def concat(self, first: Any, second: Any, first_len: int, second_len: int) -> Any: ...
    def select_rows(self, cache: Any, rows: torch.Tensor) -> Any: ...
    def trim_left(self, cache: Any, columns: int) -> Any: ...
    def nbytes(self, cache: Any) -> int: ...


class KVAllocator(Implementation):
    """Owns the memory of the KV cache; ``create`` returns the backend-facing store."""

    kind = "kv_allocator"
    layout: str = "padded"
    """The layout this allocator serves: ``padded`` for the transformers backend."""

    def create(self, model_config: Any, dtype: torch.dtype, device: torch.device) -> PaddedKVCache:
        raise NotImplementedError


@dataclass(frozen=True)
class BatchLimits:
    """The limits a scheduler admits within (TGI's names)."""

    max_batch_prefill_tokens: int
    max_batch_total_tokens: int
    max_batch_size: int | None
    padded: bool = False
    """True when the backend pads the batch to its longest prompt, so a prefill of n
    prompts costs n × the longest of them (TGI counts it the same way)."""


class SchedulerQueue(Protocol):
    """The waiting queue of one engine. Called from the engine thread only."""

    def add(self, seq: Sequence) -> None: ...
    def remove(self, seq: Sequence) -> bool: ...
    def __len__(self) -> int: ...
    def admit(self, running: list[Sequence]) -> list[Sequence]:
        """The waiting sequences to prefill now, removed from the queue."""
        ...

    def drain(self) -> list[Sequence]:
        """Remove and return every waiting sequence (at shutdown)."""
        ...


class Scheduler(Implementation):
    """Decides which waiting requests join the running batch."""

    kind = "scheduler"

    def create(self, limits: BatchLimits) -> SchedulerQueue:
        raise NotImplementedError


@dataclass
class PrefillOutput:
    """What a backend returns for newly admitted sequences."""

    last_logits: torch.Tensor
    """``[n, vocab]``: the logits after each sequence's last prompt token."""
    prompt_logits: list[torch.Tensor | None]
    """Per sequence, ``[prompt_len, vocab]`` logits when it asked for prompt details."""


class BackendRunner(Protocol):
    """A loaded model that runs engine steps. Called from the engine thread only."""

    def prefill(self, seqs: list[Sequence], want_prompt_logits: list[bool]) -> PrefillOutput:
        """Run the prompts of ``seqs`` and add them to the running batch."""
        ...

    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """One token step for every running sequence: ``[len(seqs), vocab]`` logits, in order."""
        ...

    def release(self, seqs: list[Sequence]) -> None:
        """Drop finished or cancelled sequences and free their KV memory now; unknown ones are ignored."""
        ...

    def reset(self) -> None:
        """Forget every sequence: the engine's recovery after a step failed half-way."""
        ...

    def kv_bytes(self) -> int:
        """Bytes of KV memory held now."""
        ...


class Backend(Implementation):
    """Runs a model's forward passes for the engine."""

    kind = "backend"
    kv_layout: str = "padded"
    """The KV layout this backend needs from the allocator."""

    def create(self, model: Any, kv_store: PaddedKVCache) -> BackendRunner:
        raise NotImplementedError
