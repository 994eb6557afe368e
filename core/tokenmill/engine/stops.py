"""Stop sequences found in a sequence's output as it grows, in time linear in the text and the stops.

Each stop sequence is matched with Knuth–Morris–Pratt: the matcher remembers, per stop, how many of
its leading characters the output ends with, and advances that count one new character at a time,
so no text is ever searched twice. The same counts tell a stream that leaves stop sequences out of
its text how much of the newest text it must hold back, since it could begin one (:attr:`held`).
"""

from __future__ import annotations


def prefix_table(pattern: str) -> list[int]:
    """For each prefix of ``pattern``: the length of its longest proper prefix that is also its suffix."""
    table = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = table[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        table[i] = k
    return table


class StopMatcher:
    """Where the output stands against each of a request's stop sequences."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.tables = [prefix_table(stop) for stop in stops]
        self.matched = [0] * len(stops)
        """Per stop: how many of its leading characters the output ends with."""

    def feed(self, text: str) -> bool:
        """Append ``text`` to the output; True when a stop sequence now ends in it."""
        for char in text:
            for i, stop in enumerate(self.stops):
                k, table = self.matched[i], self.tables[i]
                while k and stop[k] != char:
                    k = table[k - 1]
                if stop[k] == char:
                    k += 1
                if k == len(stop):
                    self.matched[i] = table[k - 1]  # as if it went on: overlapping matches count too
                    return True
                self.matched[i] = k
        return False

    @property
    def held(self) -> int:
        """Characters at the end of the output that could begin a stop sequence."""
        return max(self.matched, default=0)
