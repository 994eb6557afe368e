"""The step's plan: a typed value the scheduler makes and the step's execution runs, passed by value."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.engine.sequence import Sequence


@dataclass(frozen=True)
class StepPlan:
    """One step's work: the sequences that prefill (with how many of their pending tokens each)
    and those that decode one token, or more where they have a draft to verify."""

    prefill: tuple[Sequence, ...]
    chunks: tuple[int, ...]
    decode: tuple[Sequence, ...]
    drafts: tuple[tuple[int, ...], ...] = ()
    """With ``--speculate``: per decoding sequence, the draft tokens fed after its newest (``()``: none drafts)."""
    cached: tuple[int, ...] = ()
    """Per prefilling sequence, the tokens it took from the prefix cache in this step (``()``: none did).
    Blocks named in this step may be among them: only this step's forward computes those."""

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode

    @property
    def method(self) -> str:
        """TGI's name of the step in its metrics: ``prefill`` when anything prefills, else ``decode``."""
        return "prefill" if self.prefill else "decode"
