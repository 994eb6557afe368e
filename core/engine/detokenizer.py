"""Incremental detokenization that never emits a broken UTF-8 character.

Each step decodes a short window of the newest ids twice, with and without the
newest token, and emits the difference; while the window ends inside a
multi-byte character (decoded as U+FFFD) it emits nothing and waits. Special
tokens (EOS, ...) are skipped here, as they are in the final text.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        window_text = self._decode(self.ids[self.prefix_offset :])
        if len(window_text) > len(prefix_text) and not window_text.endswith(REPLACEMENT):
            new_text = window_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += new_text
            return new_text
        return ""

    def finish(self) -> str:
        """Text still held back at the end (an unfinished character), so that the
        emitted pieces add up to decoding every id at once."""
        full = self._decode(self.ids)
        rest = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += rest
        return rest
