"""Markers in text that arrives a token at a time."""

from __future__ import annotations

from collections.abc import Iterable


def held_tail(text: str, markers: Iterable[str]) -> int:
    """How many characters at the end of ``text`` may be the start of one of ``markers`` (so they
    cannot be shown yet): the longest end of ``text`` that is a proper beginning of a marker."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


def shown(text: str, markers: Iterable[str], final: bool) -> str:
    """``text`` without the tail that may still become a marker (all of it once ``final``)."""
    if final:
        return text
    return text[: len(text) - held_tail(text, markers)]


def first_of(text: str, markers: Iterable[str], start: int = 0) -> tuple[int, str]:
    """Where the first of ``markers`` begins in ``text`` from ``start``, and which one; (-1, "") if none."""
    found, which = -1, ""
    for marker in markers:
        at = text.find(marker, start)
        if at >= 0 and (found < 0 or at < found):
            found, which = at, marker
    return found, which


def lead(text: str, first_call: int, markers: Iterable[str], final: bool) -> str:
    """The text before the first call (at ``first_call``; -1: none yet), as content. Blank space at
    its end waits for what follows, as does a tail that may start a marker: before a call it is
    dropped, and only the whole output's end shows it."""
    if first_call >= 0:
        return text[:first_call].rstrip()
    if final:
        return text
    return shown(text, markers, final).rstrip()
