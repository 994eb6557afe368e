"""A logits processor that keeps words out of the output, whole or built from several tokens."""

from __future__ import annotations

from typing import Any, Callable

import torch

TAIL_TOKENS = 8
"""How many of the last tokens are decoded to see which banned word the text may be in the middle of."""


class BannedWords:
    """Bans, at each step, every token that would complete a banned word (case-insensitive): one
    that contains it, or one that starts with its rest when the text so far ends with its start.
    The token tables are built once per tokenizer, on first use."""

    def __init__(self, words: list[str]) -> None:
        self.words = [w.lower() for w in words]
        self.tokenizer: Any = None
        self.containing: torch.Tensor | None = None
        self.completing: dict[tuple[str, int], torch.Tensor] = {}
        """(word, k) -> the tokens whose text starts with ``word[k:]``."""

    def _build(self, tokenizer: Any) -> None:
        texts = [tokenizer.decode([i]).lower() for i in range(len(tokenizer))]
        self.containing = torch.tensor([i for i, t in enumerate(texts) if any(w in t for w in self.words)],
                                       dtype=torch.long)
        for word in self.words:
            for k in range(1, len(word)):
                rest = word[k:]
                self.completing[(word, k)] = torch.tensor(
                    [i for i, t in enumerate(texts) if t.startswith(rest)], dtype=torch.long)
        self.tokenizer = tokenizer

    def processor(self, tokenizer: Any) -> Callable[[list[int], torch.Tensor], torch.Tensor]:
        if self.tokenizer is not tokenizer:
            self._build(tokenizer)
        assert self.containing is not None

        def ban(token_ids: list[int], scores: torch.Tensor) -> torch.Tensor:
            tail = tokenizer.decode(token_ids[-TAIL_TOKENS:]).lower()
            banned = [self.containing]
            for word in self.words:
                banned += [self.completing[(word, k)] for k in range(1, len(word)) if tail.endswith(word[:k])]
            scores = scores.clone()
            scores[torch.cat(banned)] = float("-inf")
            return scores

        return ban
