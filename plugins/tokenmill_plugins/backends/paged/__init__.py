"""The ``paged`` and ``flash`` backends: packed steps over a block pool, on the unmodified model.

Each step packs the tokens of every scheduled sequence (prefill chunks, and decode tokens with
their drafts under ``--speculate``) into one row, with each token's own position. The model runs
with transformers' attention routed, through ``AttentionInterface``, to the kernel plugin (see
:mod:`.attention`), which attends, per sequence, over its own blocks. Any model whose layers
use that interface runs this way. ``flash`` is the same backend with the flash-attn kernel.

On CPU the forward may be compiled (:meth:`PagedRunner.compile_forward`, ``--compile-model``):
inductor fuses what lies between the matmuls (norms, rotary, activations, residual adds).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

import tokenmill
from tokenmill.engine.prefix import BlockChain, cacheable_blocks, full_block_hashes
from tokenmill.engine.sequence import Sequence
from tokenmill.interfaces import (
    NO_HIT,
    AttentionKernel,
    Backend,
    BackendRunner,
    BlockPool,
    CachingBlockPool,
    PagedStep,
    PrefillOutput,
    PrefixHit,
    StepOutput,
    blocks_for,
    padded_block_tables,
)
from tokenmill.kernels.accelerators import flash_attn_unavailable_reason
from tokenmill.model.compat import packed_steps_unavailable_reason
from tokenmill.model.compile import inductor_unavailable_reason
from tokenmill.model.kv_memory import model_kv_shape
from tokenmill.model.lora import adapter_rows, lora_batch
from tokenmill_plugins.backends.paged.attention import ATTENTION_NAME, paged_attention_forward
from tokenmill_plugins.backends.paged.compiled import CompiledForward

log = logging.getLogger(__name__)

BUILD_ATTEMPTS = 3
"""Tries at building the compiled forward in the background. Dynamo traces the model while the engine
runs it eagerly in another thread, and transformers' output capturing is not thread-safe under
torch.compile: a guard built from a value the engine thread changed meanwhile fails the trace."""


class PagedRunner(BackendRunner):
    chunked_prefill = True
    pausable = True
    speculative = True

    def __init__(self, model: Any, pool: BlockPool, kernel: AttentionKernel) -> None:
        self.model = model
        self.pool = pool
        self.kernel = kernel
        self.device = next(model.parameters()).device
        self.compiled: CompiledForward | None = None
        """The compiled forward once :meth:`compile_forward` ran (the next step compiles it) or
        :meth:`build_compiled_forward` built it."""
        self.prefix_caching = False
        """Set by :meth:`enable_prefix_caching`: full blocks are named and reused across sequences."""
        self._chains: dict[int, BlockChain] = {}
        """Per sequence holding blocks (with prefix caching): the names of the blocks it has filled."""
        self._unconfirmed: list[int] = []
        """Blocks named for the coming forward: forgotten again if it fails, since they were never computed."""
        self._drafted: dict[int, tuple[int, tuple[int, ...]]] = {}
        """Per sequence that fed a draft in the last step: the position of its first token, and the draft."""

    def compile_unavailable_reason(self) -> str | None:
        """Why :meth:`compile_forward` cannot run here, or None."""
        if self.device.type != "cpu":
            return f"compiled steps are built and measured on CPU only (the model runs on {self.device.type})"
        if lora_batch(self.model) is not None:
            return "LoRA adapters change the layers' work per request"
        return inductor_unavailable_reason()

    def compile_forward(self) -> None:
        """Run later steps through ``torch.compile`` (inductor): one graph for every step size, since
        the token count is left symbolic; the first step pays the compile (tens of seconds)."""
        self.compiled = CompiledForward(self.model)

    def build_compiled_forward(self) -> None:
        """Compile the forward now, from a thread other than the engine's, on made-up steps of its own;
        steps run eagerly until it is built, and through it from then on. Raises if the compile fails
        (the forward then stays eager) when each of :data:`BUILD_ATTEMPTS` failed."""
        for attempt in range(1, BUILD_ATTEMPTS + 1):
            forward = CompiledForward(self.model)
            try:
                forward.build(self.pool, self.kernel, self.device)
            except Exception as error:  # noqa: BLE001 - tried again, then raised
                if attempt == BUILD_ATTEMPTS:
                    raise
                log.warning("building the compiled forward failed (%s: %s); trying again", type(error).__name__, error)
                continue
            self.compiled = forward
            return

    def prefix_caching_unavailable_reason(self) -> str | None:
        """Why :meth:`enable_prefix_caching` cannot run with this KV pool, or None."""
        if not isinstance(self.pool, CachingBlockPool):
            return f"the KV pool ({type(self.pool).__name__}) keeps no cached blocks"
        return None

    def enable_prefix_caching(self) -> None:
        """Keep finished sequences' full blocks and let new prompts that begin the same way take them."""
        reason = self.prefix_caching_unavailable_reason()
        if reason:
            raise ValueError(reason)
        self.prefix_caching = True

    @property
    def kv_block_size(self) -> int:
        return self.pool.block_size

    def kv_free_tokens(self) -> int:
        return self.pool.free_blocks() * self.pool.block_size

    def kv_usage(self) -> dict[str, int]:
        used = self.pool.num_blocks - self.pool.free_blocks()
        usage = {"bytes": used * self.pool.bytes_per_block(), "blocks_used": used, "blocks_total": self.pool.num_blocks}
        if self.prefix_caching:
            usage["blocks_cached"] = self.pool.cached_blocks()  # type: ignore[attr-defined]
        return usage

    # ---- prefix caching (engine thread; the pool is a CachingBlockPool) ----------------------

    def prefix_hit(self, seq: Sequence, planned: frozenset[bytes] = frozenset()) -> PrefixHit:
        if not self.prefix_caching or seq.num_computed or seq.wants_prompt_logits:
            return NO_HIT
        block_size = self.pool.block_size
        hashes = full_block_hashes(seq, block_size, cacheable_blocks(seq.total_len, block_size))
        pool: CachingBlockPool = self.pool  # type: ignore[assignment]
        blocks = pool.lookup(hashes)
        count = len(blocks)
        while count < len(hashes) and hashes[count] in planned:
            count += 1
        return PrefixHit(count * block_size, pool.idle_among(blocks))

    def plan_prefill(self, seq: Sequence, chunk: int) -> None:
        if self._chains.get(seq.id) is None and not self.pool.blocks_of(seq.id):
            self._take_cached(seq)
        self._reserve(seq, seq.total_len)
        self._fill_chain(seq, seq.num_computed + chunk)

    def _take_cached(self, seq: Sequence) -> None:
        """Start a sequence that holds no blocks: its first ``num_computed`` tokens (what :meth:`prefix_hit`
        found) from cached blocks. Nothing is taken unless its whole context then fits the pool."""
        pool: CachingBlockPool = self.pool  # type: ignore[assignment]
        block_size = pool.block_size
        hashes = full_block_hashes(seq, block_size, seq.num_computed // block_size)
        blocks = pool.lookup(hashes)
        if len(blocks) < len(hashes):
            raise RuntimeError(f"sequence {seq.id}: {len(hashes) - len(blocks)} of its cached blocks are gone")
        new_blocks = blocks_for(seq.total_len, block_size) - len(blocks)
        if new_blocks + pool.idle_among(blocks) > pool.free_blocks():
            raise MemoryError(f"the KV pool has no room for sequence {seq.id} ({seq.total_len} tokens)")
        if blocks:
            pool.share(seq.id, blocks)
        self._chains[seq.id] = BlockChain(seq.cache_namespace, block_size, hashes)

    def _fill_chain(self, seq: Sequence, computed: int) -> None:
        """Name the blocks that are full once the sequence's first ``computed`` tokens are in the cache."""
        chain = self._chains.get(seq.id)
        if chain is None or chain.tokens >= computed:
            return
        start = chain.tokens
        # A decoding sequence passes only its newest token (a shard's view of it carries no others).
        tokens = [seq.last_token] if start == seq.total_len - 1 else seq.token_ids[start:computed]
        table = self.pool.blocks_of(seq.id)
        for index, block_hash in chain.extend(tokens):
            if self.pool.name(table[index], block_hash):  # type: ignore[attr-defined]
                self._unconfirmed.append(table[index])

    def reset_prefix_cache(self) -> int:
        return self.pool.drop_cached() if self.prefix_caching else 0  # type: ignore[attr-defined]

    def _blocks_short(self, seq: Sequence, tokens: int) -> int:
        return max(0, blocks_for(tokens, self.pool.block_size) - len(self.pool.blocks_of(seq.id)))

    def can_decode(self, seqs: list[Sequence]) -> bool:
        return sum(self._blocks_short(s, s.total_len) for s in seqs) <= self.pool.free_blocks()

    def release(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.pool.free(seq.id)
            self._chains.pop(seq.id, None)
            self._drafted.pop(seq.id, None)

    def reset(self) -> None:
        """Forget every sequence, and every cached block: after a step failed half-way, what they hold
        cannot be trusted."""
        self.pool.free_all()
        self._chains.clear()
        self._drafted.clear()
        self._unconfirmed = []
        if isinstance(self.pool, CachingBlockPool):
            self.pool.drop_cached()

    def _reserve(self, seq: Sequence, tokens: int) -> None:
        if not self.pool.reserve(seq.id, tokens):
            raise MemoryError(f"the KV pool has no free block for sequence {seq.id} ({tokens} tokens)")

    @torch.inference_mode()
    def step(self, prefill: list[Sequence], chunks: list[int], want_prompt_logits: list[bool],
             decode: list[Sequence], drafts: list[tuple[int, ...]] | None = None) -> StepOutput:
        """Prefill chunks, decode tokens and their drafts packed into one row: one forward pass for the whole step."""
        try:
            out = self._step(prefill, chunks, want_prompt_logits, decode, drafts)
        except BaseException:
            self._forget_unconfirmed()
            self._drop_drafts(decode)
            raise
        self._unconfirmed = []
        return out

    def _forget_unconfirmed(self) -> None:
        for block in self._unconfirmed:
            self.pool.unname(block)  # type: ignore[attr-defined]
        self._unconfirmed = []

    def _step(self, prefill: list[Sequence], chunks: list[int], want_prompt_logits: list[bool],
              decode: list[Sequence], drafts: list[tuple[int, ...]] | None) -> StepOutput:
        for seq in prefill + decode:
            self._reserve(seq, seq.total_len)  # a prompt's whole context at once: later chunks never wait
        fed = self._reserve_drafts(decode, drafts) if drafts else [()] * len(decode)
        if self.prefix_caching:
            for seq, chunk in zip(prefill, chunks):
                self._fill_chain(seq, seq.num_computed + chunk)
            for seq in decode:
                self._fill_chain(seq, seq.total_len)
        starts = [s.num_computed for s in prefill] + [s.total_len - 1 for s in decode]
        lengths = list(chunks) + [1 + len(draft) for draft in fed]
        step, input_ids, positions = self._pack(prefill + decode, starts, lengths, [()] * len(prefill) + fed)
        wants = list(want_prompt_logits) + [bool(draft) for draft in fed]
        keep = [torch.arange(start, start + n) if want else torch.tensor([start + n - 1])
                for start, n, want in zip(step.query_starts, lengths, wants)]
        with adapter_rows(self.model, prefill + decode, lengths):
            logits = self._forward(input_ids, positions, step, torch.cat(keep))
        bounds = [0]
        for kept in keep:
            bounds.append(bounds[-1] + len(kept))
        firsts, lasts = torch.tensor(bounds[:-1]), torch.tensor(bounds[1:]) - 1
        prefill_out = None
        if prefill:
            prompt_logits = [logits[bounds[row] : bounds[row + 1]] if want else None
                             for row, want in enumerate(want_prompt_logits)]
            prefill_out = PrefillOutput(logits[lasts[: len(prefill)]], prompt_logits)
        decode_logits = logits[firsts[len(prefill) :]] if decode else None
        draft_logits = None
        if drafts:
            draft_logits = [logits[bounds[row] + 1 : bounds[row + 1]] for row in range(len(prefill), len(keep))]
        return StepOutput(prefill_out, decode_logits, draft_logits=draft_logits)

    # ---- drafts (--speculate) -------------------------------------------------------------------

    def _reserve_drafts(self, decode: list[Sequence], drafts: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """The drafts each decoding sequence feeds: its own where KV memory holds them, else none."""
        fed: list[tuple[int, ...]] = []
        for seq, draft in zip(decode, drafts):
            if draft and not self.pool.reserve(seq.id, seq.total_len + len(draft)):
                draft = ()
            if draft:
                self._drafted[seq.id] = (seq.total_len, tuple(draft))  # where the draft's first token goes
            fed.append(tuple(draft))
        return fed

    def _drop_drafts(self, decode: list[Sequence]) -> None:
        """After a failed step: forget its drafts and the KV memory reserved for them."""
        truncate = getattr(self.pool, "truncate", None)
        for seq in decode:
            if self._drafted.pop(seq.id, None) is not None and truncate is not None:
                truncate(seq.id, seq.num_computed)

    def rollback(self, seqs: list[Sequence]) -> None:
        """Name the blocks that accepted drafts filled (prefix caching) and drop the KV of rejected ones."""
        for seq in seqs:
            start, draft = self._drafted.pop(seq.id, (0, ()))
            if not draft or seq.num_computed < start:  # none, or it got no token (cancelled, failed): it ends now
                continue
            accepted = seq.num_computed - start  # its KV holds every kept token but the newest
            chain = self._chains.get(seq.id)
            if chain is not None and accepted > 0:
                table = self.pool.blocks_of(seq.id)
                for index, block_hash in chain.extend(list(draft[:accepted])):
                    self.pool.name(table[index], block_hash)  # type: ignore[attr-defined]
            truncate = getattr(self.pool, "truncate", None)
            if truncate is not None:
                truncate(seq.id, seq.num_computed)

    def _pack(self, seqs: list[Sequence], starts: list[int], lengths: list[int],
              drafts: list[tuple[int, ...]]) -> tuple[PagedStep, torch.Tensor, torch.Tensor]:
        """The packed row of this step's tokens (a decoding sequence's newest, then its draft), their
        positions, and where their KV goes."""
        block_size = self.pool.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[torch.Tensor] = []
        query_starts: list[int] = []
        block_tables = padded_block_tables(self.pool, [s.id for s in seqs])
        for row, (seq, start, length) in enumerate(zip(seqs, starts, lengths)):
            query_starts.append(len(tokens))
            is_last_token = start == seq.total_len - 1
            tokens.extend([seq.last_token, *drafts[row]] if is_last_token else seq.token_ids[start : start + length])
            span = torch.arange(start, start + length)
            positions.extend(range(start, start + length))
            slots.append(block_tables[row, span // block_size].long() * block_size + span % block_size)
        context = [start + length for start, length in zip(starts, lengths)]
        step = PagedStep(
            pool=self.pool, kernel=self.kernel, slot_mapping=torch.cat(slots).to(self.device),
            query_starts=query_starts, query_lens=list(lengths), context_lens=context,
            block_tables=block_tables.to(self.device), max_context_len=max(context),
        )
        as_row = lambda values: torch.tensor([values], dtype=torch.long, device=self.device)  # noqa: E731
        return step, as_row(tokens), as_row(positions)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: PagedStep,
                 keep: torch.Tensor) -> torch.Tensor:
        keep = keep.to(self.device)
        out = self._compiled_forward(input_ids, positions, step, keep) if self.compiled is not None else None
        if out is None:
            out = self.model(input_ids=input_ids, position_ids=positions, use_cache=False, logits_to_keep=keep,
                             paged_step=step)
        return out.logits[0].float().cpu()

    def _compiled_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: PagedStep,
                          keep: torch.Tensor) -> Any:
        """The model's output through the compiled forward; None when its first call (the compile) failed,
        which leaves the runner eager from then on."""
        forward = self.compiled
        try:
            return forward(input_ids, positions, step, keep)
        except Exception as error:  # noqa: BLE001 - a failed compile must not stop a server that can run eagerly
            if forward.ran:
                raise
            log.warning("compiling the forward failed (%s: %s); it runs eagerly", type(error).__name__, error)
            self.compiled = None  # the eager forward then writes the same KV slots again
            return None


class PagedBackend(Backend):
    name = "paged"
    kv_layout = "paged"
    mixed_steps = True
    default_attention = "sdpa"
    default_kv_allocator = "paged"
    description = "packed steps over a block pool, KV allocated on demand (any model using AttentionInterface)"

    def model_unavailable_reason(self, model: Any) -> str | None:
        return packed_steps_unavailable_reason(model, self.name) or super().model_unavailable_reason(model)

    def create(self, model: Any, kv_store: BlockPool, attention: AttentionKernel) -> BackendRunner:
        reason = self.model_unavailable_reason(model)
        if reason:
            raise ValueError(reason)
        from transformers import AttentionInterface  # here, not at the top: importing it costs seconds

        AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
        model.set_attn_implementation(ATTENTION_NAME)
        return PagedRunner(model, kv_store, attention)


class FlashBackend(PagedBackend):
    name = "flash"
    default_attention = "flash"
    description = "the paged backend with flash-attn's variable-length kernels (CUDA)"

    def unavailable_reason(self) -> str | None:
        return flash_attn_unavailable_reason()

    def model_unavailable_reason(self, model: Any) -> str | None:
        reason = super().model_unavailable_reason(model)
        if reason:
            return reason
        dtype = next(model.parameters()).dtype
        if dtype not in (torch.float16, torch.bfloat16):
            return (f"flash-attn runs float16 and bfloat16 only (the model is {str(dtype).replace('torch.', '')}); "
                    "use --dtype bfloat16 or --backend paged")
        _, _, head_dim = model_kv_shape(model.config)
        if head_dim > 256 or head_dim % 8:
            return (f"flash-attn needs a head dimension of at most 256 and a multiple of 8 (the model has {head_dim}); "
                    "use --backend paged")
        return None


@tokenmill.hookimpl
def tokenmill_backends() -> list[Backend]:
    return [PagedBackend(), FlashBackend()]
