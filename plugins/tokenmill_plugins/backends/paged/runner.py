"""The paged runner: one step's prefill chunks, decode tokens and drafts packed into one row, one forward.

Each token gets its own position; the model runs with transformers' attention routed, through
``AttentionInterface``, to the kernel plugin (see :mod:`.attention`), which attends, per sequence, over
its own blocks. On CPU the forward may be compiled (:meth:`PagedRunner.compile_forward`,
``--compile-model``): inductor fuses what lies between the matmuls (norms, rotary, activations, residual adds).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tokenmill.interfaces import (
    AttentionKernel,
    BackendRunner,
    BlockPool,
    CachingBlockPool,
    PagedStep,
    PrefillOutput,
    StepOutput,
    padded_block_tables,
)
from tokenmill.model.compile import inductor_unavailable_reason
from tokenmill.model.loading import cache_dir
from tokenmill.model.lora import adapter_rows, lora_batch
from tokenmill.model.offload import WeightFile
from tokenmill.model.vision import encode_sequences, place_rotary
from tokenmill_plugins.backends.paged.compiled import CompiledForward
from tokenmill_plugins.backends.paged.saved_forward import saved_forward_path

log = logging.getLogger(__name__)

BUILD_ATTEMPTS = 3
"""Tries at building the compiled forward in the background. Dynamo traces the model while the engine
runs it eagerly in another thread, and transformers' output capturing is not thread-safe under
torch.compile: a guard built from a value the engine thread changed meanwhile fails the trace."""


class PagedRunner(BackendRunner):
    """Runs each step's forward over the block tables of :attr:`kv_pool`, which the engine's KV-cache
    manager fills: this runner only reads them (to pack a step) and keeps no cache state."""

    chunked_prefill = True
    pausable = True
    speculative = True
    takes_images = True

    def __init__(self, model: Any, pool: BlockPool, kernel: AttentionKernel) -> None:
        self.model = model
        self.kv_pool = pool
        """The pool whose blocks the engine's KV-cache manager allocates to sequences."""
        self.kernel = kernel
        self.device = next(model.parameters()).device
        self.compiled: CompiledForward | None = None
        """The compiled forward once :meth:`compile_forward` ran (the next step compiles it) or
        :meth:`build_compiled_forward` built it."""
        self.weights: WeightFile | None = None
        """Where the weights go while the server sleeps (once it first slept)."""
        self.prefix_caching = False
        """Set by :meth:`enable_prefix_caching`: the engine names full blocks and reuses them across sequences."""

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
        self.compiled = CompiledForward(self.model, saved_forward_path(self.model))

    def compiled_forward_saved(self) -> bool:
        """Whether an earlier start on this machine saved the compiled forward of this model and settings."""
        return saved_forward_path(self.model).is_file()

    def build_compiled_forward(self) -> bool:
        """Compile the forward now (or load the one an earlier start saved), from a thread other than the
        engine's, on made-up steps of its own; steps run eagerly until it is built, and through it from then
        on. Returns whether it was loaded. Raises if the compile fails (the forward then stays eager) when
        each of :data:`BUILD_ATTEMPTS` failed."""
        for attempt in range(1, BUILD_ATTEMPTS + 1):
            forward = CompiledForward(self.model, saved_forward_path(self.model))
            try:
                forward.build(self.kv_pool, self.kernel, self.device)
            except Exception as error:  # noqa: BLE001 - tried again, then raised
                if attempt == BUILD_ATTEMPTS:
                    raise
                log.warning("building the compiled forward failed (%s: %s); trying again", type(error).__name__, error)
                continue
            self.compiled = forward
            return forward.loaded
        return False

    def prefix_caching_unavailable_reason(self) -> str | None:
        """Why :meth:`enable_prefix_caching` cannot run with this KV pool, or None."""
        if not isinstance(self.kv_pool, CachingBlockPool):
            return f"the KV pool ({type(self.kv_pool).__name__}) keeps no cached blocks"
        return None

    def enable_prefix_caching(self) -> None:
        """Keep finished sequences' full blocks and let new prompts that begin the same way take them."""
        reason = self.prefix_caching_unavailable_reason()
        if reason:
            raise ValueError(reason)
        self.prefix_caching = True

    def release_memory(self) -> int:
        """Give the KV pool's memory and, on CPU, the weights' back to the operating system while nothing runs
        (the server sleeps); the weights come back from a file as the forward reads them."""
        release = getattr(self.kv_pool, "release_memory", None)
        released = release() if release is not None else 0
        if self.device.type == "cpu":
            try:
                self.weights = self.weights or WeightFile(cache_dir() / "sleep")
                released += self.weights.put_away(self.model)
            except OSError as error:
                log.warning("the weights stay in memory while asleep: %s", error)
        return released

    @property
    def kv_block_size(self) -> int:
        return self.kv_pool.block_size

    @torch.inference_mode()
    def step(self, prefill: list[Any], chunks: list[int], want_prompt_logits: list[bool], decode: list[Any],
             drafts: list[tuple[int, ...]] | None = None) -> StepOutput:
        """Prefill chunks, decode tokens and their drafts packed into one row: one forward pass for the whole
        step, over the blocks the engine allocated for it (drafts included)."""
        fed = [tuple(draft) for draft in drafts] if drafts else [()] * len(decode)
        starts = [s.num_computed for s in prefill] + [s.total_len - 1 for s in decode]
        lengths = list(chunks) + [1 + len(draft) for draft in fed]
        step, input_ids, positions = self._pack(prefill + decode, starts, lengths, [()] * len(prefill) + fed)
        place_rotary(self.model, prefill)
        positions = self._rotary(prefill + decode, starts, lengths, positions)
        wants = list(want_prompt_logits) + [bool(draft) for draft in fed]
        keep = [torch.arange(start, start + n) if want else torch.tensor([start + n - 1])
                for start, n, want in zip(step.query_starts, lengths, wants)]
        embeds = self._with_images(input_ids, prefill, starts, chunks, step.query_starts)
        with adapter_rows(self.model, prefill + decode, lengths):
            logits = self._forward(input_ids, positions, step, torch.cat(keep), embeds)
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

    def _pack(self, seqs: list[Any], starts: list[int], lengths: list[int],
              drafts: list[tuple[int, ...]]) -> tuple[PagedStep, torch.Tensor, torch.Tensor]:
        """The packed row of this step's tokens (a decoding sequence's newest, then its draft), their
        positions, and where their KV goes."""
        block_size = self.kv_pool.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[torch.Tensor] = []
        query_starts: list[int] = []
        block_tables = padded_block_tables(self.kv_pool, [s.id for s in seqs])
        for row, (seq, start, length) in enumerate(zip(seqs, starts, lengths)):
            query_starts.append(len(tokens))
            is_last_token = start == seq.total_len - 1
            tokens.extend([seq.last_token, *drafts[row]] if is_last_token else seq.token_ids[start : start + length])
            span = torch.arange(start, start + length)
            positions.extend(range(start, start + length))
            slots.append(block_tables[row, span // block_size].long() * block_size + span % block_size)
        context = [start + length for start, length in zip(starts, lengths)]
        step = PagedStep(
            pool=self.kv_pool, kernel=self.kernel, slot_mapping=torch.cat(slots).to(self.device),
            query_starts=query_starts, query_lens=list(lengths), context_lens=context,
            block_tables=block_tables.to(self.device), max_context_len=max(context),
        )
        as_row = lambda values: torch.tensor([values], dtype=torch.long, device=self.device)  # noqa: E731
        return step, as_row(tokens), as_row(positions)

    def _rotary(self, seqs: list[Any], starts: list[int], lengths: list[int], positions: torch.Tensor) -> torch.Tensor:
        """The step's positions as the model takes them: ``[3, 1, tokens]`` where the multimodal rotary positions
        of a sequence's image tokens differ from axis to axis, else one row (the same on every axis)."""
        if all(seq.rotary_positions is None for seq in seqs):
            return positions
        axes = torch.cat([seq.rotary_positions.at(start, length) if seq.rotary_positions is not None
                          else torch.arange(start, start + length).expand(3, -1)
                          for seq, start, length in zip(seqs, starts, lengths)], dim=1)
        if torch.equal(axes[0], axes[1]) and torch.equal(axes[0], axes[2]):
            return axes[:1].to(self.device)  # one row: the compiled forward takes it
        return axes.unsqueeze(1).to(self.device)

    def _with_images(self, input_ids: torch.Tensor, prefill: list[Any], starts: list[int], chunks: list[int],
                     query_starts: list[int]) -> torch.Tensor | None:
        """The step's input embeddings with its prompts' image embeddings at their image tokens' positions
        (the images of every prompt that first reaches them in this step encoded together); None when no
        chunk of the step holds an image token."""
        placed: list[tuple[Any, list[int], slice]] = []
        for seq, start, row_start, length in zip(prefill, starts, query_starts, chunks):
            images = seq.images
            if images is None:
                continue
            first, last = images.placed_before(start), images.placed_before(start + length)
            if first < last:
                rows = [row_start + position - start for position in images.positions[first:last]]
                placed.append((seq, rows, slice(first, last)))
        if not placed:
            return None
        encode_sequences(self.model, [seq for seq, _, _ in placed])
        embeds = self.model.get_input_embeddings()(input_ids)
        for seq, rows, taken in placed:
            embeds[0, rows] = seq.image_embeddings[taken].to(embeds.dtype)
        return embeds

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: PagedStep,
                 keep: torch.Tensor, embeds: torch.Tensor | None = None) -> torch.Tensor:
        keep = keep.to(self.device)
        # Image embeddings go through the eager forward, which takes them in place of token ids; positions of
        # three axes (only where images are) too.
        if embeds is None and self.compiled is not None and positions.dim() == 2:
            logits = self._compiled_forward(input_ids, positions, step, keep)
            if logits is not None:
                return logits[0].float().cpu()
        inputs = {"input_ids": input_ids} if embeds is None else {"inputs_embeds": embeds}
        out = self.model(**inputs, position_ids=positions, use_cache=False, logits_to_keep=keep, paged_step=step)
        return out.logits[0].float().cpu()

    def _compiled_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: PagedStep,
                          keep: torch.Tensor) -> torch.Tensor | None:
        """The logits through the compiled forward; None when its first call (the compile) failed,
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
