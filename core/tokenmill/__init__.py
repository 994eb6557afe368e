"""tokenmill: an LLM inference server with TGI's HTTP API on a pluggy plugin core."""

from __future__ import annotations

import pluggy

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("tokenmill")
"""Marker for plugin hook implementations: ``@tokenmill.hookimpl``."""

__all__ = ["__version__", "hookimpl"]
