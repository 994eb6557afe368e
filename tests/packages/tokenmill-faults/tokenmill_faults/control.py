"""The control file: which faults to inject now, and what was injected.

``$TOKENMILL_FAULTS`` names a JSON object (see the package's README for its keys). Every call
reads the file (a few hundred bytes) and parses it again when its text changed; each new text (a
test writes a temporary file and ``os.replace``s it, with a ``_version`` key of its own so that the
same settings written twice are two versions) starts the counts afresh. So a test never has to
undo what an earlier one wrote, nor race the server writing the file back: only the test writes it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import Counter
from typing import Any

VARIABLE = "TOKENMILL_FAULTS"

log = logging.getLogger("tokenmill_faults")


class InjectedFault(RuntimeError):
    """What every injected failure raises (a RuntimeError, as a real kernel's would be)."""


class Control:
    """The fault settings of one process, and its counts: per key, how often it fired."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path if path is not None else os.environ.get(VARIABLE) or None
        self._lock = threading.Lock()
        self._text: str | None = None
        self.settings: dict[str, Any] = {}
        self.version = 0
        """How many versions of the file were read (0: none yet)."""
        self.used: Counter[str] = Counter()
        """Per key, how often it fired since this version of the file was read."""
        self.fired: Counter[str] = Counter()
        """Per key, how often it fired since the process started."""
        self.calls: Counter[str] = Counter()
        """Per place (``attention``, ``admit``, ...), how often it was called."""

    def _current(self) -> dict[str, Any]:
        if not self.path:
            return {}
        try:
            with open(self.path, encoding="utf-8") as file:
                text: str | None = file.read()
        except OSError:
            text = None
        if text != self._text:
            self._text = text
            settings: Any = {}
            try:
                settings = json.loads(text or "{}")
            except ValueError as error:
                log.warning("tokenmill-faults: cannot read %s (%s): no faults", self.path, error)
            self.settings = settings if isinstance(settings, dict) else {}
            self.used.clear()
            self.version += 1
            if self.settings:
                log.warning("tokenmill-faults: version %d of the faults: %s", self.version, self.settings)
        return self.settings

    def get(self, key: str, default: Any = None) -> Any:
        """The setting ``key`` of the file as it is now."""
        with self._lock:
            return self._current().get(key, default)

    def snapshot(self) -> dict[str, Any]:
        """The settings as they are now (one read for several keys)."""
        with self._lock:
            return dict(self._current())

    def take(self, key: str, budget: Any = None) -> bool:
        """Whether the counted fault ``key`` fires now (its setting, or ``budget`` when given: N times,
        -1 forever); a fault that fires is counted."""
        with self._lock:
            if budget is None:
                budget = self._current().get(key)
            if isinstance(budget, bool):
                budget = 1 if budget else 0
            if not isinstance(budget, int) or budget == 0:
                return False
            if budget > 0 and self.used[key] >= budget:
                return False
            self.used[key] += 1
            self.fired[key] += 1
        log.warning("tokenmill-faults: injecting %s", key)
        return True

    def once(self, key: str) -> Any:
        """The value of ``key`` the first time it is asked for in this version of the file, else None
        (a fault that fires once per version, such as ``hang``)."""
        with self._lock:
            value = self._current().get(key)
            if value is None or self.used[key]:
                return None
            self.used[key] += 1
            self.fired[key] += 1
        log.warning("tokenmill-faults: injecting %s=%s", key, value)
        return value

    def note(self, place: str) -> None:
        with self._lock:
            self.calls[place] += 1

    def report(self) -> dict[str, Any]:
        """What ``GET /faults`` answers."""
        with self._lock:
            settings = dict(self._current())
            return {"path": self.path, "version": self.version, "settings": settings, "used": dict(self.used),
                    "fired": dict(self.fired), "calls": dict(self.calls), "pid": os.getpid()}


CONTROL = Control()
"""The one control of this process, on ``$TOKENMILL_FAULTS`` as it was when the plugin was imported."""
