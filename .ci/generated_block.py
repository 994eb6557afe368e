"""A Markdown page with one generated block between two marker comments, and the rest written by hand.

Shared by the scripts that generate reference blocks (``hooks_reference.py``, ``configuration_reference.py``):
replacing the block, the diff that says a page is stale, and the command line (rewrite, or ``--check``).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

MAX_DIFF_LINES = 60


@dataclass(frozen=True)
class GeneratedBlock:
    """Where one generated block lives and what makes it."""

    page: Path
    """The page, by default."""
    label: str
    """The page's name in messages and diffs (``hooks.md``)."""
    source: str
    """What the block is generated from, for the diff's header (``core/tokenmill/hookspecs.py``)."""
    what: str
    """The block's name in messages (``hook reference``)."""
    script: str
    """The command that rewrites it (``python .ci/hooks_reference.py``)."""
    begin: str
    end: str

    def replaced(self, text: str, block: str) -> str:
        """``text`` with the part from ``begin`` to ``end`` replaced by ``block`` (markers included)."""
        start = text.find(self.begin)
        end = text.find(self.end, start + len(self.begin)) if start >= 0 else -1
        if end < 0:
            raise ValueError(f"{self.label} lacks the markers {self.begin!r} ... {self.end!r}")
        return text[:start] + block + text[end + len(self.end):]

    def stale_diff(self, text: str, block: str) -> str:
        """A unified diff from ``text`` to ``text`` with ``block``; empty when ``text`` is up to date."""
        expected = self.replaced(text, block)
        lines = list(difflib.unified_diff(text.splitlines(keepends=True), expected.splitlines(keepends=True),
                                          self.label, f"{self.label} from {self.source}", n=1))
        if len(lines) > MAX_DIFF_LINES:
            lines = [*lines[:MAX_DIFF_LINES], f"... ({len(lines) - MAX_DIFF_LINES} more diff lines)\n"]
        return "".join(lines)

    def main(self, argv: Sequence[str] | None, description: str, render: Callable[[], str]) -> int:
        """Rewrite the block in place with what ``render`` gives, or with ``--check`` say whether it is stale
        (a diff on stderr, exit 1)."""
        parser = argparse.ArgumentParser(description=description)
        parser.add_argument("--check", action="store_true", help=f"do not write; exit 1 when {self.label} is stale")
        parser.add_argument("--path", type=Path, default=self.page,
                            help=f"the page to update (default: {self.label})")
        args = parser.parse_args(argv)
        text = args.path.read_text()
        if args.check:
            diff = self.stale_diff(text, render())
            if diff:
                print(f"{args.path}: the {self.what} is stale; run {self.script}\n{diff}", end="", file=sys.stderr)
                return 1
            return 0
        updated = self.replaced(text, render())
        if updated != text:
            args.path.write_text(updated)
            print(f"{args.path}: {self.what} rewritten")
        return 0
