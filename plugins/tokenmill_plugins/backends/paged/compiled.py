"""The paged forward through ``torch.compile`` (inductor, CPU), and building it off the engine thread.

A compile takes tens of seconds, even with inductor's caches warm (dynamo traces the model again
in every process); loading one an earlier start saved (:mod:`.saved_forward`) takes a few. Built in
the engine's first steps, it holds ``/health`` back that long; built
by :meth:`CompiledForward.build` in another thread, on made-up steps over a scratch KV block of
its own, it lets the server answer at once with the eager forward and take the compiled one
when it is ready. Dynamo's frame hook is per thread, so the engine's eager steps never trace.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tokenmill.interfaces import AttentionKernel, BlockPool, PagedStep
from tokenmill.model.cpu_linears import has_packed_linears
from tokenmill_plugins.backends.paged import saved_forward
from tokenmill_plugins.backends.paged.attention import current_step

BUILD_STEPS = ((8, 1), (1, 1), (3, 3))
"""The made-up steps :meth:`CompiledForward.build` runs, as (tokens, logits kept): a prefill, a
decode and a decode verifying a draft of two."""


def logits_of(model: Any, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """What a forward compiled ahead of time runs: the model, given as an input, so that its weights are
    the graph's inputs too."""
    return model(input_ids=input_ids, position_ids=positions, use_cache=False, logits_to_keep=keep).logits


class CompiledForward:
    """The model's forward compiled for every step size: the token count is left symbolic.

    Where tokenmill packed the model's linear layers, the weights are the graph's inputs, and the forward is
    compiled ahead of time (``torch.compile``'s ``aot_compile``) at its first call, or loaded from
    ``saved_at`` where an earlier start saved it (then in seconds), and saved there once compiled. Otherwise
    inductor freezes the weights in as constants (and packs them itself): such a graph is compiled at its
    first call by every start."""

    def __init__(self, model: Any, saved_at: Path | None = None) -> None:
        self.model = model
        self.freezing = not has_packed_linears(model)
        """Weights as the graph's constants, so that inductor packs them for oneDNN itself: where tokenmill
        did not pack them. Such a graph cannot be saved."""
        self.saved_at = None if self.freezing else saved_at
        self.compiled = torch.compile(model, dynamic=True, fullgraph=True) if self.freezing else None
        self.ahead: Any = None
        """The forward compiled ahead of time (or loaded), once the first call made it; None while freezing."""
        self.loaded = False
        """Whether :attr:`ahead` came from the file an earlier start saved."""
        self.ran = False
        """Whether a call went through, the compile with it: later calls skip dynamo's guards."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, step: PagedStep,
                 keep: torch.Tensor) -> torch.Tensor:
        """The logits of the rows ``keep`` names, ``[1, rows, vocabulary]``."""
        for tensor, dim in ((input_ids, 1), (positions, 1), (keep, 0)):
            # Unbacked: sizes of 1 (one decode row, one kept logit) share the graph instead of their own.
            torch._dynamo.decorators.mark_unbacked(tensor, dim)
        token = current_step.set(step)
        try:
            # Python floats (the attention scale, norms' epsilon) as constants: traced as symbols, they made
            # dynamo start its analysis over, 16 s of a 56 s compile.
            with torch._dynamo.config.patch(specialize_float=True):
                logits = self._frozen(input_ids, positions, keep) if self.freezing \
                    else self._ahead_of_time(input_ids, positions, keep)
        finally:
            current_step.reset(token)
        self.ran = True
        return logits

    def _ahead_of_time(self, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        if self.ahead is None:
            self.ahead = saved_forward.load(self.saved_at) if self.saved_at is not None else None
            self.loaded = self.ahead is not None
        if self.ahead is None:
            # No guards: every step has the same kinds of inputs (token ids, positions and kept rows of any
            # length, the model unchanged), and a saved graph could not keep guards on transformers' objects.
            compile_ahead = torch.compile(logits_of, dynamic=True, fullgraph=True,
                                          options={"guard_filter_fn": lambda guards: [False] * len(guards)})
            self.ahead = compile_ahead.aot_compile(((self.model, input_ids, positions, keep), {}))
            self.ahead.disable_guard_check()
            if self.saved_at is not None:
                saved_forward.save(self.ahead, self.saved_at)
        return self.ahead(self.model, input_ids, positions, keep)

    def _frozen(self, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        # Freezing set per call, not through compile options: the compile happens inside the first call.
        # Once compiled, the guards are not evaluated again (as in :meth:`_ahead_of_time`): checking the
        # model's guards cost 1.4 ms a step, 9 % of a bf16 decode step of one sequence.
        with torch._inductor.config.patch(freezing=True), self._guard_stance(), self._collections_held():
            out = self.compiled(input_ids=input_ids, position_ids=positions, use_cache=False, logits_to_keep=keep)
        return out.logits

    def _guard_stance(self) -> Any:
        """Skip guard evaluation once compiled (``torch.compiler.set_stance``, torch 2.6 and later)."""
        set_stance = getattr(torch.compiler, "set_stance", None)
        if set_stance is None or not self.ran:
            return contextlib.nullcontext()
        return set_stance("default", skip_guard_eval_unsafe=True)

    def _collections_held(self) -> Any:
        """Once compiled, no garbage collection starts inside the call: one that did would run Python (a
        finalizer, a ``gc.callbacks`` entry) under dynamo's frame hook, which, its guards skipped, fails the
        step as a recompilation. The collection runs when the call returns instead. Not while compiling:
        tracing makes garbage enough to need collections."""
        return held_collections() if self.ran else contextlib.nullcontext()

    @torch.inference_mode()
    def build(self, like: BlockPool, kernel: AttentionKernel, device: torch.device) -> None:
        """Compile now, through :data:`BUILD_STEPS` over one scratch block shaped as ``like``'s, leaving
        the pool itself (which the engine thread owns) untouched."""
        scratch = ScratchPool(like)
        for tokens, kept in BUILD_STEPS:
            tokens = min(tokens, scratch.block_size)
            kept = min(kept, tokens)
            step = scratch.step(kernel, tokens, device)
            ids = torch.zeros(1, tokens, dtype=torch.long, device=device)
            positions = torch.arange(tokens, device=device).unsqueeze(0)
            self(ids, positions, step, torch.arange(tokens - kept, tokens, device=device))
        # The engine thread's first call evaluates dynamo's guards again (and its failure, unlike a later
        # one's, falls back to the eager forward instead of failing the step).
        self.ran = False


@contextlib.contextmanager
def held_collections() -> Iterator[None]:
    """Python's garbage collector off for the block (it was on: on again after)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class ScratchPool:
    """One KV block per layer, all layers sharing it, with the dtype and shape of a real pool's: what a
    made-up step writes and attends over. Its values are never read back."""

    def __init__(self, like: BlockPool) -> None:
        key, value = like.layer(0)
        self.block_size = like.block_size
        self._caches = (torch.zeros_like(key[:1]), torch.zeros_like(value[:1]))

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._caches

    def step(self, kernel: AttentionKernel, tokens: int, device: torch.device) -> PagedStep:
        """One sequence of ``tokens`` new tokens from position 0, in block 0."""
        assert tokens <= self.block_size
        return PagedStep(pool=self, kernel=kernel, slot_mapping=torch.arange(tokens, device=device),  # type: ignore[arg-type]
                         query_starts=[0], query_lens=[tokens], context_lens=[tokens],
                         block_tables=torch.zeros(1, 1, dtype=torch.int32, device=device), max_context_len=tokens)
