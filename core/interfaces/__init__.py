"""The contracts plugin implementations fulfil, one per plugin kind.

Each implementation has a ``name`` (what the flag selects), a one-line
``description`` and ``unavailable_reason()``, which returns None when the
implementation can run on this machine, else why not ("needs CUDA").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from tokenmill.engine.engine import Engine
    from tokenmill.engine.sequence import Sequence


class Implementation:
    """Base for every plugin implementation."""

    kind: str = ""
    name: str = ""
    description: str = ""

    def unavailable_reason(self) -> str | None:
        """None when this implementation can run here, else the reason it cannot."""
        return None


class Quantizer(Implementation):
    """Makes the model's weights smaller, at load or by reading a checkpoint quantized elsewhere.

    A quantizer of pre-quantized checkpoints names the ``quant_method`` of the
    ``quantization_config`` it reads (``checkpoint_method``: gptq, awq) and builds the
    model itself in ``load``; the others let the model load as usual, with
    ``from_pretrained_kwargs`` added, then change it in place in ``quantize``.
    """

    kind = "quantizer"
    checkpoint_method: str | None = None

    def load(self, path: Any, dtype: torch.dtype, device: torch.device, attn_implementation: str,
             trust_remote_code: bool) -> Any:
        """The model of a checkpoint this quantizer reads itself, or None to load it as usual."""
        return None

    def from_pretrained_kwargs(self, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
        """Extra arguments for transformers' ``from_pretrained`` (a ``quantization_config``)."""
        return {}

    def quantize(self, model: Any) -> str | None:
        """Quantize a loaded model in place; a short detail for the load log, or None when there was nothing to do."""
        return None


class AttentionKernel(Implementation):
    """An attention implementation the model's layers call.

    For the ``padded`` layout it names one of transformers' own implementations
    (``transformers_name``); for the ``paged`` layout it computes attention over
    the blocks of a :class:`BlockPool` (``paged_attention``).
    """

    kind = "attention"
    layouts: tuple[str, ...] = ("padded",)
    transformers_name: str = ""
    """The ``attn_implementation`` value transformers knows this kernel by (padded layout)."""
    block_size_multiple: int = 1
    """Block sizes this kernel accepts must be multiples of this (paged layout)."""

    def paged_attention(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        step: PagedStep, scaling: float, sliding_window: int | None = None) -> torch.Tensor:
        """Causal attention of a packed step: ``query`` is ``[tokens, heads, dim]``; the caches are
        ``[blocks, block_size, kv_heads, dim]`` and already hold this step's keys and values; a
        ``sliding_window`` limits each query to that many latest positions. Returns ``[tokens, heads, dim]``."""
        raise NotImplementedError


@runtime_checkable
class PaddedKVCache(Protocol):
    """KV storage for a left-padded batch: rows are sequences, columns are positions."""

    def new_cache(self, model_config: Any) -> Any: ...
    def concat(self, first: Any, second: Any, first_len: int, second_len: int) -> Any: ...
    def select_rows(self, cache: Any, rows: torch.Tensor) -> Any: ...
    def trim_left(self, cache: Any, columns: int) -> Any: ...
    def nbytes(self, cache: Any) -> int: ...


@runtime_checkable
class BlockPool(Protocol):
    """KV storage in fixed-size blocks shared by all sequences (the paged layout)."""

    block_size: int
    num_blocks: int

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value blocks of one layer, each ``[blocks, block_size, kv_heads, dim]``."""
        ...

    def free_blocks(self) -> int: ...
    def blocks_of(self, seq_id: int) -> list[int]: ...
    def reserve(self, seq_id: int, tokens: int) -> bool:
        """Make the sequence's blocks hold ``tokens`` positions; False (nothing taken) when the pool is short."""
        ...

    def free(self, seq_id: int) -> None:
        """Return the sequence's blocks to the free list (shared ones when their last user lets go)."""
        ...

    def free_all(self) -> None: ...
    def bytes_per_block(self) -> int: ...


@runtime_checkable
class CachingBlockPool(BlockPool, Protocol):
    """A block pool that keeps computed blocks for reuse (automatic prefix caching).

    A full block may be *named* by the hash of its contents (see :mod:`tokenmill.engine.prefix`). A named
    block whose last holder lets go stays in the pool as *cached*, unreferenced, in least recently
    used order, instead of returning to the free list; ``free_blocks()`` counts it as free, and
    ``reserve`` evicts the least recently used cached block once the free list is empty."""

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The blocks named by the leading ``hashes``, up to the first that no block bears (the pool is not changed)."""
        ...

    def idle_among(self, blocks: list[int]) -> int:
        """How many of ``blocks`` no sequence holds now (cached, counted as free)."""
        ...

    def share(self, seq_id: int, blocks: list[int]) -> None:
        """Start the (empty) table of ``seq_id`` with ``blocks``, each held once more."""
        ...

    def name(self, block: int, block_hash: bytes) -> bool:
        """Name a full, computed block; False (nothing done) when another block bears that hash already."""
        ...

    def unname(self, block: int) -> None:
        """Forget a block's name (its contents were never computed); an unheld one returns to the free list."""
        ...

    def drop_cached(self) -> int:
        """Free every cached block no sequence holds; returns how many."""
        ...

    def cached_blocks(self) -> int:
        """Blocks that bear a name, held or not."""
        ...


class KVAllocator(Implementation):
    """Owns the memory of the KV cache; ``create`` returns the backend-facing store."""

    kind = "kv_allocator"
    layout: str = "padded"
    """The layout this allocator serves: ``padded`` (transformers backend) or ``paged``."""

    def create(self, model_config: Any, dtype: torch.dtype, device: torch.device, max_tokens: int,
               block_size: int) -> PaddedKVCache | BlockPool:
        """The store for one model; a paged pool holds ``max_tokens`` positions in ``block_size`` blocks."""
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
    waiting_served_ratio: float = 0.3
    """While a batch runs, newcomers join only when at least this × its size of them can."""
    max_waiting_tokens: int = 20
    """... or when this many decode steps have passed since the last admission."""
    priority_class_weights: tuple[tuple[str, float], ...] = (("high", 4000.0), ("normal", 2000.0), ("low", 0.0))
    """The ``priority`` scheduler's weight of each request class."""
    priority_aging: float = 100.0
    """... plus this much weight per second a request has waited ..."""
    priority_cost: float = 1.0
    """... minus this much per token of its expected cost (prompt + ``max_new_tokens``)."""


@dataclass(frozen=True)
class StepBudget:
    """What one engine step can still take in, as the engine sees it when it asks to admit."""

    prefill_tokens: int
    """Prompt tokens this step can still prefill."""
    chunked: bool
    """Whether a prompt longer than ``prefill_tokens`` may start now and go on in later steps."""
    kv_free_tokens: int | None
    """KV positions free now (paged); None when KV memory follows ``max_batch_total_tokens``."""
    block_size: int = 1
    prefix: PrefixLookup | None = None
    """Where the prompts' computed prefixes are looked up; None when the backend caches none."""


@dataclass(frozen=True)
class PrefixHit:
    """The leading tokens of a sequence whose keys and values the KV pool holds already."""

    tokens: int
    """Tokens that need no prefill (whole blocks; never the last token, whose logits are needed)."""
    idle_blocks: int = 0
    """Of the blocks it would take, those no sequence holds now: taking them uses up free KV memory."""


NO_HIT = PrefixHit(0)


class PrefixLookup(Protocol):
    """Answers, without changing anything, how much of a waiting sequence's context is cached."""

    def prefix_hit(self, seq: Sequence, planned: frozenset[bytes] = frozenset()) -> PrefixHit:
        """The cached prefix ``seq`` would take if it started now; ``planned`` names blocks that sequences
        admitted earlier in the same step will compute, which it would share too."""
        ...


class SchedulerQueue(Protocol):
    """The waiting queue of one engine. Called from the engine thread only (``__len__`` from anywhere)."""

    def add(self, seq: Sequence) -> None: ...
    def requeue(self, seq: Sequence) -> None:
        """Put a preempted sequence back, ahead of those that never ran."""
        ...

    def remove(self, seq: Sequence) -> bool: ...
    def __len__(self) -> int: ...
    def admit(self, holding: list[Sequence], budget: StepBudget) -> list[Sequence]:
        """The waiting sequences to start prefilling now, removed from the queue.
        ``holding`` are the sequences that already hold KV memory."""
        ...

    def drain(self) -> list[Sequence]:
        """Remove and return every waiting sequence (at shutdown)."""
        ...

    def pending(self) -> list[Sequence]:
        """The waiting sequences in the order they would start (for ``GET /queue``); the queue is not changed."""
        ...

    # Optional: a queue may also define
    #     preempt(self, running: list[Sequence], budget: StepBudget) -> list[Preemption]
    # which the engine calls before ``admit`` each step: the running sequences to set
    # aside now so that waiting ones can start. They are requeued and resume later with
    # the same output.


@dataclass(frozen=True)
class Preemption:
    """A running sequence a scheduler sets aside for waiting ones."""

    seq: Sequence
    keep_kv: bool
    """True: it only gives up its place in the batch and keeps its KV memory, and resumes without
    recomputing (where the backend can leave rows out of a step; otherwise it is treated as
    False). False: its KV memory is freed and its tokens are recomputed when it resumes."""


class Scheduler(Implementation):
    """Decides which waiting requests join the running batch."""

    kind = "scheduler"

    def create(self, limits: BatchLimits) -> SchedulerQueue:
        raise NotImplementedError


@dataclass
class PagedStep:
    """The layout of one packed forward pass, built once per step and read by every layer."""

    pool: BlockPool
    kernel: AttentionKernel
    slot_mapping: torch.Tensor
    """``[tokens]``: the flat KV slot (block × block_size + offset) of each token of the step."""
    query_starts: list[int]
    """Per sequence, where its tokens start in the packed step."""
    query_lens: list[int]
    context_lens: list[int]
    """Per sequence, its positions in the cache after this step (the keys its queries see)."""
    block_tables: torch.Tensor
    """``[sequences, max_blocks]`` int32, padded with 0."""
    max_context_len: int
    scratch: dict[str, Any] = field(default_factory=dict)
    """Where a kernel keeps what it derives once per step (index tensors, masks) for every layer."""


@dataclass
class PrefillOutput:
    """What a backend returns for the sequences it prefilled this step."""

    last_logits: torch.Tensor
    """``[n, vocab]``: the logits after each sequence's last token of this step."""
    prompt_logits: list[torch.Tensor | None]
    """Per sequence, ``[chunk, vocab]`` logits when it asked for prompt details."""


@dataclass
class StepOutput:
    prefill: PrefillOutput | None
    decode_logits: torch.Tensor | None
    """``[len(decode), vocab]``: the logits after each decoding sequence's newest token."""
    prefill_error: Exception | None = None
    """Set by a backend that runs prefill apart from decode when only the prefill failed."""


class BackendRunner(Protocol):
    """A loaded model that runs engine steps. Called from the engine thread only."""

    chunked_prefill: bool
    """Whether a step accepts part of a prompt (the rest follows in later steps)."""
    pausable: bool
    """Whether a step may leave out some of the running sequences (they keep their KV memory):
    what backpressure from slow clients needs."""
    kv_block_size: int
    """Positions per KV block (1 where memory is not counted in blocks)."""

    def step(self, prefill: list[Sequence], chunks: list[int], want_prompt_logits: list[bool],
             decode: list[Sequence]) -> StepOutput:
        """One engine step. For each ``prefill`` sequence, compute its next ``chunks[i]`` uncomputed
        tokens (its prompt, and after a preemption the tokens it had generated too) and keep their
        KV; for each ``decode`` sequence, feed its newest token. Both in one forward pass where the
        backend can."""
        ...

    def can_decode(self, seqs: list[Sequence]) -> bool:
        """Whether KV memory holds one more token for each of ``seqs`` (else the engine preempts)."""
        ...

    def kv_free_tokens(self) -> int | None:
        """KV positions free now, or None when memory is not counted in blocks."""
        ...

    def release(self, seqs: list[Sequence]) -> None:
        """Drop finished or cancelled sequences and free their KV memory now; unknown ones are ignored."""
        ...

    def reset(self) -> None:
        """Forget every sequence: the engine's recovery after a step failed half-way."""
        ...

    def kv_usage(self) -> dict[str, int]:
        """KV memory now: ``bytes`` held, and for a block pool ``blocks_used`` and ``blocks_total``
        (and ``blocks_cached`` where it caches prefixes)."""
        ...

    # Prefix caching: a runner that reuses computed prompt prefixes sets ``prefix_caching`` and
    # implements the three methods below (the engine calls them only then).
    prefix_caching: bool = False

    def prefix_hit(self, seq: Sequence, planned: frozenset[bytes] = frozenset()) -> PrefixHit:
        """:meth:`PrefixLookup.prefix_hit`: the cached prefix a sequence holding no KV memory would take."""
        return NO_HIT

    def plan_prefill(self, seq: Sequence, chunk: int) -> None:
        """Called while the engine plans a step, for each sequence that prefills ``chunk`` tokens in it,
        in the order they will run, before :meth:`step`. A sequence holding no KV memory whose
        ``num_computed`` the engine set from :meth:`prefix_hit` first takes those cached blocks. Then
        its whole context is reserved and the blocks complete after this chunk are named, so that a
        sequence planned after it in the same step shares them. MemoryError when the pool is short."""

    def reset_prefix_cache(self) -> int:
        """Drop every cached block that no sequence holds; returns how many."""
        return 0


@dataclass
class EngineSetup:
    """What tokenmill hands a backend that brings its own engine, in place of a loaded model."""

    model_path: Path
    """A local transformers checkpoint directory (a GGUF file is converted to one first)."""
    model_id: str
    tokenizer: Any
    """The tokenizer tokenmill validates, detokenizes and stops with."""
    model_config: Any
    """The checkpoint's transformers config."""
    dtype: torch.dtype
    device: torch.device
    config: Any
    """The server's :class:`tokenmill.config.Config` (limits, ``--max-batch-size``, ``--dtype``)."""
    eos_ids: set[int]
    pm: Any
    """The plugin manager, for the engine's hooks (logits processors)."""
    new_queue: Callable[[int], SchedulerQueue]
    """The chosen scheduler's queue for a KV memory of that many positions; call it once, when the
    engine knows its size (it settles ``--max-batch-total-tokens`` and the other limits)."""


class Backend(Implementation):
    """Runs a model's forward passes for the engine, or, with ``owns_engine``, is the engine."""

    kind = "backend"
    kv_layout: str = "padded"
    """The KV layout this backend needs from the allocator and the attention kernel."""
    default_attention: str = "sdpa"
    default_kv_allocator: str = "dynamic"
    mixed_steps: bool = False
    """True when its steps prefill newcomers (in chunks) in the same forward as the running batch
    decodes: a join then costs the batch only a longer step, so the admission defaults differ
    (``--waiting-served-ratio`` 0, and on CPU at most 2048 prompt tokens a step; see
    :meth:`tokenmill.config.Config.resolve_limits`)."""
    owns_engine: bool = False
    """True for a backend that loads the model and schedules, samples and keeps KV memory in an engine
    of its own (vLLM's): tokenmill then loads only the tokenizer and calls :meth:`create_engine`
    instead of :meth:`create`, and the attention and KV-allocator flags do not apply."""

    def model_unsupported_reason(self, model: Any) -> str | None:
        """None when this backend can run ``model``, else why not (one line)."""
        return None

    def create(self, model: Any, kv_store: Any, attention: AttentionKernel) -> BackendRunner:
        raise NotImplementedError

    def create_engine(self, setup: EngineSetup) -> Engine:
        """(``owns_engine`` only.) Load the model into this backend's own engine and return a
        :class:`tokenmill.engine.engine.Engine` subclass that drives it, not started."""
        raise NotImplementedError
