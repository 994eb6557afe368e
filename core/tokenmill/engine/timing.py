"""Step timing: how long each engine step and its forward pass took, for the metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class StepTiming:
    """How one step that ran the model went, as the metrics record it."""

    method: str
    """``prefill`` when anything prefilled in it, else ``decode``."""
    prefilling: int
    """Sequences that prefilled in it (TGI's next batch: the requests that joined)."""
    forward_seconds: float
    step_seconds: float
    ok: bool
    speculated: Speculated | None = None
    """What drafts gave in it (``--speculate``), or None when no sequence drafted."""


@dataclass(frozen=True)
class Speculated:
    """A step's drafts: tokens the model checked, tokens they added, and per drafting sequence, its added tokens."""

    drafted: int
    accepted: int
    skipped: tuple[int, ...]
    """TGI's ``tgi_request_skipped_tokens``: per sequence that drafted, the tokens it got beyond one."""


class StepClock:
    """Times one step: start it, mark when the forward pass returned, then take its timing."""

    def __init__(self, method: str, prefilling: int) -> None:
        self.method, self.prefilling = method, prefilling
        self.started = self.forwarded_at = time.perf_counter()

    def forwarded(self) -> None:
        self.forwarded_at = time.perf_counter()

    def timing(self, ok: bool, speculated: Speculated | None = None) -> StepTiming:
        ended = time.perf_counter()
        return StepTiming(self.method, self.prefilling, self.forwarded_at - self.started, ended - self.started, ok,
                          speculated)
