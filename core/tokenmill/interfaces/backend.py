"""The backend kind: the runner of a loaded model's steps and what it returns, or an engine of its own."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from tokenmill.interfaces.base import Implementation
from tokenmill.interfaces.kv import NO_HIT

if TYPE_CHECKING:
    import torch

    from tokenmill.engine.engine import Engine
    from tokenmill.engine.sequence import Sequence
    from tokenmill.interfaces.attention import AttentionKernel
    from tokenmill.interfaces.kv import BlockPool, PrefixHit


@dataclass(frozen=True)
class PrefillOutput:
    """What a backend returns for the sequences it prefilled this step."""

    last_logits: torch.Tensor
    """``[n, vocab]``: the logits after each sequence's last token of this step."""
    prompt_logits: list[torch.Tensor | None]
    """Per sequence, ``[chunk, vocab]`` logits when it asked for prompt details."""


@dataclass(frozen=True)
class StepOutput:
    prefill: PrefillOutput | None
    decode_logits: torch.Tensor | None
    """``[len(decode), vocab]``: the logits after each decoding sequence's newest token."""
    prefill_error: Exception | None = None
    """Set by a backend that runs prefill apart from decode when only the prefill failed."""
    draft_logits: list[torch.Tensor] | None = None
    """With drafts: per decoding sequence, ``[m, vocab]``, the logits after each of the first ``m`` tokens of
    its draft that it fed (``m`` may be fewer than drafted, 0 included, where KV memory was short)."""


class BackendRunner(Protocol):
    """A loaded model that runs engine steps. Called from the engine thread only."""

    chunked_prefill: bool
    """Whether a step accepts part of a prompt (the rest follows in later steps)."""
    pausable: bool
    """Whether a step may leave out some of the running sequences (they keep their KV memory):
    what backpressure from slow clients needs."""
    kv_block_size: int
    """Positions per KV block (1 where memory is not counted in blocks)."""

    speculative: bool = False
    """Whether :meth:`step` takes ``drafts`` (``--speculate``)."""
    takes_images: bool = False
    """Whether :meth:`step` places a prompt's image embeddings (``Sequence.images``, a vision-language model's;
    ``tokenmill.model.vision.encode_sequences`` encodes them) at its image tokens. The engine refuses requests
    with images (422) for a runner that does not."""
    kv_pool: BlockPool | None = None
    """A runner over a block pool names it here: the engine's KV-cache manager then allocates, names and frees
    its blocks (:mod:`tokenmill.engine.kv_cache`), the runner only reads each sequence's block table, and the
    KV calls below (:meth:`can_decode` to :meth:`reset_prefix_cache`) are never made. None: the runner keeps
    its own KV memory and answers them."""

    def step(self, prefill: list[Sequence], chunks: list[int], want_prompt_logits: list[bool],
             decode: list[Sequence], drafts: list[tuple[int, ...]] | None = None) -> StepOutput:
        """One engine step. For each ``prefill`` sequence, compute its next ``chunks[i]`` uncomputed
        tokens (its prompt, and after a preemption the tokens it had generated too) and keep their
        KV; for each ``decode`` sequence, feed its newest token, then (a ``speculative`` runner, when
        ``drafts`` is given) the tokens of ``drafts[i]``, and return the logits after each
        (:attr:`StepOutput.draft_logits`). Both in one forward pass where the backend can."""
        ...

    def rollback(self, seqs: list[Sequence]) -> None:
        """(``speculative``, no ``kv_pool``) After a step with drafts, once the engine appended the tokens it
        kept: drop the KV of each sequence's positions from its ``num_computed`` on that the step wrote (rejected
        drafts), so that its KV memory holds only tokens it kept. Sequences that end in this step are
        among ``seqs`` (released right after); one that got no token (cancelled, failed) has a
        ``num_computed`` below its draft's first position and needs nothing."""
        raise NotImplementedError("a speculative runner drops its rejected drafts in rollback")

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
    """The server's :class:`tokenmill.config.Config` (limits, ``--max-batch-size``, ``--dtype``);
    after :attr:`new_queue` was called, with its limits settled."""
    eos_ids: set[int]
    pm: Any
    """The plugin manager, for the engine's hooks (logits processors)."""
    new_queue: Callable[[int], Any]
    """The chosen scheduler's queue for a KV memory of that many positions, as the engine admits from it
    (:class:`tokenmill.engine.scheduling.Admission`: ``admit(holding, budget)``, ``requeue``, ...); call it
    once, when the engine knows its size (it settles ``--max-batch-total-tokens`` and the other limits)."""


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
    :meth:`tokenmill.config.Config.with_limits`)."""
    owns_engine: bool = False
    """True for a backend that loads the model and schedules, samples and keeps KV memory in an engine
    of its own (vLLM's): tokenmill then loads only the tokenizer and calls :meth:`create_engine`
    instead of :meth:`create`, and the attention and KV-allocator flags do not apply."""

    def model_unavailable_reason(self, model: Any) -> str | None:
        """None when this backend can run ``model``, else why not (one line)."""
        return self.model_unsupported_reason(model)

    def model_unsupported_reason(self, model: Any) -> str | None:
        """This method's name in hooks 1.0, which backends written for it may still override."""
        return None

    def create(self, model: Any, kv_store: Any, attention: AttentionKernel) -> BackendRunner:
        raise NotImplementedError

    def create_engine(self, setup: EngineSetup) -> Engine:
        """(``owns_engine`` only.) Load the model into this backend's own engine and return a
        :class:`tokenmill.engine.engine.Engine` subclass that drives it, not started."""
        raise NotImplementedError
