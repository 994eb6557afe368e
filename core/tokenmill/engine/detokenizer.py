"""Incremental detokenization that never emits a broken UTF-8 character.

Each step decodes a short window of the newest ids twice, with and without the
newest token, and emits the difference; while the window ends inside a
multi-byte character (decoded as U+FFFD) it emits nothing and waits. Special
tokens (EOS, ...) are skipped here, as they are in the final text.

A fast tokenizer does this in Rust (``tokenizers.decoders.DecodeStream``, the
same window rule, one decode per token instead of two Python round trips); the
Python window is the fallback for slow tokenizers and for the rare step where
the stream refuses a window, from which the sequence continues in Python.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


def decode_stream_for(tokenizer: Any) -> tuple[Any, Any] | None:
    """A fresh ``DecodeStream`` and the backend tokenizer it steps with, or None when the tokenizer
    has no Rust backend (a slow tokenizer) or the installed ``tokenizers`` has no DecodeStream."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None
    if not isinstance(backend, Tokenizer):
        return None
    return DecodeStream(skip_special_tokens=True), backend


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, use_stream: bool = True) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        """The Python window: ids[prefix_offset:read_offset] are decoded context already emitted."""
        self.text = ""
        self.stream = decode_stream_for(tokenizer) if use_stream else None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        if self.stream is not None:
            decoder, backend = self.stream
            try:
                new_text = decoder.step(backend, token_id)
            except Exception:  # noqa: BLE001 - the stream refused its window (e.g. an invalid prefix)
                self.stream = None  # the Python window's offsets follow every emission, so it takes over
            else:
                return self._emitted(new_text or "")
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        window_text = self._decode(self.ids[self.prefix_offset :])
        if len(window_text) > len(prefix_text) and not window_text.endswith(REPLACEMENT):
            return self._emitted(window_text[len(prefix_text) :])
        return ""

    def _emitted(self, new_text: str) -> str:
        """Record text the newest token completed: the window moves past it (as DecodeStream's does)."""
        if new_text:
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += new_text
        return new_text

    def finish(self) -> str:
        """Text still held back at the end (an unfinished character), so that the
        emitted pieces add up to decoding every id at once."""
        full = self._decode(self.ids)
        rest = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += rest
        return rest
