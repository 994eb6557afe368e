"""Whether the engine can still serve: a run of failed steps, or one step that never ends, breaks it.

One failed step is taken as transient (its sequences fail, the next step runs); ``max_failed_steps``
failed in a row (``--max-failed-steps``) say the device or a plugin is broken for good. A watchdog
thread ends the wait for a step that runs longer than ``step_timeout`` seconds (``--step-timeout``: a
hung kernel, or a collective waiting for a dead shard). Either way the engine is then broken: it
tells every request, /health says 503, and the server exits so that its supervisor restarts it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from tokenmill.engine.sequence import GenerationRequest, Sequence
from tokenmill.sampling import SamplingParams

if TYPE_CHECKING:
    from tokenmill.engine.kv_cache import KVCacheManager
    from tokenmill.engine.runner_kv import RunnerKV
    from tokenmill.interfaces import BackendRunner

log = logging.getLogger(__name__)

Broken = Callable[[str], None]
"""Told once, from the engine thread or the watchdog's, why the engine broke."""


class EngineHealth:
    """Counts consecutive failed steps and watches the step in progress."""

    def __init__(self, on_broken: Broken, max_failed_steps: int = 5, step_timeout: float | None = None) -> None:
        self.on_broken = on_broken
        self.max_failed_steps = max_failed_steps
        self.step_timeout = step_timeout
        self.failed_steps = 0
        """Failed steps since the last one that succeeded."""
        self.broken: str | None = None
        """Why the engine broke, once it has."""
        self.busy_since: float | None = None
        """When the engine thread's current step began (None between steps)."""
        self._lock = threading.Lock()
        self._watchdog: threading.Thread | None = None

    def configure(self, max_failed_steps: int, step_timeout: float | None) -> None:
        self.max_failed_steps, self.step_timeout = max_failed_steps, step_timeout

    def step_began(self) -> None:
        self.busy_since = time.monotonic()

    def step_done(self) -> None:
        self.busy_since = None

    def step_ended(self, ok: bool) -> None:
        """A step that ran the model (or asked the scheduler) succeeded or failed."""
        if ok:
            self.failed_steps = 0
            return
        self.failed_steps += 1
        if self.failed_steps >= self.max_failed_steps:
            self.give_up(f"{self.failed_steps} engine steps in a row failed (--max-failed-steps)")

    def give_up(self, reason: str) -> None:
        """Mark the engine broken (once; from any thread) and tell ``on_broken``."""
        with self._lock:
            if self.broken is not None:
                return
            self.broken = reason
        log.error("the engine is broken: %s", reason)
        self.on_broken(reason)

    def watch(self, engine_thread: threading.Thread) -> None:
        """Watch the steps of ``engine_thread``, while it lives, from a thread of its own (when a step
        timeout is set)."""
        if self.step_timeout is None or self._watchdog is not None:
            return
        self._watchdog = threading.Thread(target=self._watch, args=(engine_thread,), name="tokenmill-watchdog",
                                          daemon=True)
        self._watchdog.start()

    def _watch(self, engine_thread: threading.Thread) -> None:
        assert self.step_timeout is not None
        period = min(1.0, self.step_timeout / 4)
        while self.broken is None and engine_thread.is_alive():
            time.sleep(period)
            started = self.busy_since
            if started is not None and time.monotonic() - started > self.step_timeout:
                self.give_up(f"an engine step has run for more than {self.step_timeout:g} s (--step-timeout)")


def probe(runner: BackendRunner, kv: KVCacheManager | RunnerKV) -> bool:
    """After a step whose every part failed: whether a made-up one-token prefill runs on ``runner`` (its
    memory from ``kv``), that is, whether the failure was its requests' own and the engine can still serve."""
    seq = Sequence(GenerationRequest("", [0], 1, SamplingParams()), lambda event: None, None)
    try:
        kv.allocate(seq, 0, 1)
        return runner.step([seq], [1], [False], []).prefill_error is None
    except Exception:  # noqa: BLE001 - the engine's failure: counted towards --max-failed-steps
        log.exception("a probe step failed too")
        return False
    finally:
        kv.free([seq])
