"""The base of every plugin implementation."""

from __future__ import annotations


class Implementation:
    """Base for every plugin implementation."""

    kind: str = ""
    name: str = ""
    description: str = ""

    def unavailable_reason(self) -> str | None:
        """None when this implementation can run here, else the reason it cannot."""
        return None
