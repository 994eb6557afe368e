"""n-gram speculation (``--speculate N``): draft tokens for the decoding sequences, without a draft model.

A sequence's draft is the tokens that followed the latest earlier occurrence of its last few
tokens, in its prompt or its output (TGI's n-gram speculation, vLLM's ``ngram`` method). The
backend feeds a decoding sequence its newest token and its draft in one forward, and returns the
logits after each; :meth:`tokenmill.engine.output.Output.sample` then chooses one token at a time
from them, as single steps would have, keeping drafts while each equals the token chosen.

Drafting is adaptive, so that it costs little where it cannot help: a sequence whose draft was
wholly rejected drafts again only after a pause that doubles with each miss in a row; a step
drafts no more than :data:`STEP_TOKENS` query tokens in all (prompt chunks and decode rows
count), since past that a step is bound by compute and draft tokens that are rejected cost as
much as any other.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tokenmill.engine.sequence import Sequence

NGRAM_MAX = 3
"""The longest suffix looked up: the last 3 tokens, then 2."""
NGRAM_MIN = 2
"""The shortest: single tokens recur too often in free text to predict what follows."""

STEP_TOKENS = {"cpu": 24, "cuda": 256}
"""The most query tokens (prefill chunks, decode rows and drafts) a step may have for any row of it to draft,
by device type: where a forward stops being bound by reading the weights. On 2 CPU cores a SmolLM2
forward costs about the same from 1 to ~30 tokens."""

MAX_PAUSE = 32
"""The longest pause after misses, in tokens generated without drafting."""

log = logging.getLogger(__name__)


class NgramIndex:
    """Where each n-gram of a growing token list (n from :data:`NGRAM_MIN` to :data:`NGRAM_MAX`) last ended."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], int] = {}
        """An n-gram -> the position just after its latest occurrence that is not the list's own suffix."""
        self._indexed = 0
        """n-grams that end before this position are in ``_ends``."""

    def sync(self, seq: Sequence) -> None:
        """Catch up with the sequence's tokens (its prompt, then what it generated since the last call)."""
        if not self.tokens:
            self.tokens.extend(seq.prompt_ids)
        self.tokens.extend(seq.generated_ids[len(self.tokens) - seq.prompt_len:])

    def draft(self, most: int) -> list[int]:
        """Up to ``most`` tokens that followed the latest earlier occurrence of the longest suffix found."""
        tokens, ends = self.tokens, self._ends
        length = len(tokens)
        for end in range(self._indexed + 1, length):  # every n-gram but the suffix itself
            for n in range(NGRAM_MIN, min(NGRAM_MAX, end) + 1):
                ends[tuple(tokens[end - n:end])] = end
        self._indexed = max(self._indexed, length - 1)
        for n in range(min(NGRAM_MAX, length), NGRAM_MIN - 1, -1):
            end = ends.get(tuple(tokens[length - n:]))
            if end is not None:
                return tokens[end:end + most]
        return []


@dataclass
class DraftState:
    """A sequence's drafting: its n-gram index, its pause after misses, and its counts."""

    index: NgramIndex = field(default_factory=NgramIndex)
    drafted: int = 0
    """Draft tokens the model checked."""
    accepted: int = 0
    """Of those, the ones kept (each a token produced without a step of its own: TGI's skipped tokens)."""
    misses: int = 0
    """Drafts in a row of which nothing was kept."""
    resume_at: int = 0
    """It drafts again once it has generated this many tokens."""


def draft_state(seq: Sequence) -> DraftState:
    if seq.speculation is None:
        seq.speculation = DraftState()
    return seq.speculation


class Speculator:
    """Proposes each step's drafts and learns from what was kept."""

    def __init__(self, tokens: int, step_tokens: int) -> None:
        self.tokens = tokens
        """``--speculate``: the most draft tokens per sequence and step."""
        self.step_tokens = step_tokens

    def propose(self, decode: tuple[Sequence, ...], prefill_tokens: int) -> tuple[tuple[int, ...], ...]:
        """The drafts of ``decode``'s sequences (in its order; empty ones included), or () when none drafts or
        drafting failed: drafts are an optimisation, a step without them is still right."""
        try:
            return self._propose(decode, prefill_tokens)
        except Exception:  # noqa: BLE001 - logged; this step decodes without drafts
            log.exception("proposing drafts failed; this step decodes without them")
            return ()

    def _propose(self, decode: tuple[Sequence, ...], prefill_tokens: int) -> tuple[tuple[int, ...], ...]:
        room = self.step_tokens - prefill_tokens - len(decode)
        drafts: list[tuple[int, ...]] = []
        for seq in decode:
            most = min(self.tokens, room, seq.request.max_new_tokens - len(seq.generated_ids) - 1)
            draft: tuple[int, ...] = ()
            if most > 0 and not seq.cancelled and len(seq.generated_ids) >= draft_state(seq).resume_at:
                draft = tuple(self.draft(seq, most))
            room -= len(draft)
            drafts.append(draft)
        return tuple(drafts) if any(drafts) else ()

    def draft(self, seq: Sequence, most: int) -> list[int]:
        """Up to ``most`` draft tokens for ``seq``: what followed the latest earlier occurrence of its last tokens."""
        index = draft_state(seq).index
        index.sync(seq)
        return index.draft(most)

    @staticmethod
    def observe(seq: Sequence, produced: int) -> None:
        """``seq`` drafted in a step that produced ``produced`` tokens for it: a miss when only one."""
        state = draft_state(seq)
        if produced > 1:
            state.misses = 0
            return
        state.misses += 1
        state.resume_at = len(seq.generated_ids) + min(MAX_PAUSE, 2 ** (state.misses - 1))


class FixedDrafts(Speculator):
    """Drafts a sequence's first prompt tokens, whatever it generated: the warm-up's, to run a verifying step."""

    def draft(self, seq: Sequence, most: int) -> list[int]:
        return seq.prompt_ids[:most]
