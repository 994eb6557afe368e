"""One model of a several-model server: its own app (the routes, a :class:`ServerState`, its engine and KV
budget), created when the model is first asked for and closed when it is unloaded."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from typing import Any

import pluggy

from tokenmill.config import Config
from tokenmill.http.app import create_app
from tokenmill.http.body import ApiError
from tokenmill.http.holding import loaded
from tokenmill.http.state import ServerState
from tokenmill.model import kv_memory

log = logging.getLogger(__name__)

RETRY_SECONDS = 10.0
"""How long a model whose load failed answers with that error before a request loads it again."""


class AppLifespan:
    """Drives an ASGI app's lifespan (start-up, shut-down) as a server would."""

    def __init__(self, app: Any) -> None:
        self.to_app: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.from_app: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        self.task = asyncio.ensure_future(app(scope, self.to_app.get, self.from_app.put))

    async def run(self, event: str) -> None:
        """Send ``startup`` or ``shutdown`` and wait for the app's answer (raises RuntimeError when it failed)."""
        if self.task.done():  # it ended (a start-up that failed): nothing to shut down
            return
        await self.to_app.put({"type": f"lifespan.{event}"})
        answered = asyncio.ensure_future(self.from_app.get())
        await asyncio.wait({answered, self.task}, return_when=asyncio.FIRST_COMPLETED)
        if not answered.done():
            answered.cancel()
            raise RuntimeError(f"the app ended during its {event}: {self.task.exception()!r}")
        answer = answered.result()
        if answer["type"] != f"lifespan.{event}.complete":
            raise RuntimeError(answer.get("message") or f"the {event} failed")
        if event == "shutdown":
            await self.task


class ServedModel:
    """A model the router serves by ``name``; ``app`` is None while it is not loaded."""

    def __init__(self, name: str, config: Config, pm: pluggy.PluginManager) -> None:
        self.name = name
        self.config = config
        self.pm = pm
        self.app: Any = None
        self.lifespan: AppLifespan | None = None
        self.open = 0
        """Requests routed to it and not yet answered."""
        self.last_used = 0.0
        self.opened_at = 0.0

    @property
    def state(self) -> ServerState | None:
        """Its app's state, or None while it is not loaded."""
        return self.app.state if self.app is not None else None

    @property
    def status(self) -> str:
        """unloaded, loading, loaded or failed (its last load)."""
        state = self.state
        if state is None:
            return "unloaded"
        if state.load_error is not None:
            return "failed"
        return "loaded" if loaded(state) else "loading"

    @property
    def evictable(self) -> bool:
        """Loaded (or failed) with no request open: it may be unloaded to make room."""
        return self.open == 0 and self.status in ("loaded", "failed")

    async def open_app(self) -> None:
        """Create its app and start its lifespan: the model loads in a thread of its own."""
        log.info("loading model %s (%s)", self.name, self.config.model_id)
        self.opened_at = time.monotonic()
        try:
            app = create_app(self.config, self.pm)
        except Exception as error:  # noqa: BLE001 - a plugin's route hook that fails: this model cannot serve
            log.exception("model %s: its app could not be built", self.name)
            raise ApiError(503, f"the model '{self.name}' cannot be served: {type(error).__name__}: {error}",
                           "unhealthy") from None
        app.state.exit_when_load_fails = False  # the other models go on serving; its requests get the error
        self.app, self.lifespan = app, AppLifespan(app)
        try:
            await self.lifespan.run("startup")
        except RuntimeError as error:  # its start-up failed before the load began: answered as a failed load
            app.state.load_error = str(error)

    async def close(self) -> None:
        """Stop its engine and drop the app; the memory goes back to the system."""
        lifespan, self.app, self.lifespan = self.lifespan, None, None
        if lifespan is not None:
            log.info("unloading model %s", self.name)
            try:
                await lifespan.run("shutdown")
            except RuntimeError as error:
                log.warning("model %s: its shutdown failed (%s); it is dropped anyway", self.name, error)
        gc.unfreeze()  # the heap frozen at its start-up holds its objects too; the next start freezes it again
        gc.collect()
        kv_memory.trim_heap()

    def touch(self) -> None:
        """It was just used (the least recently used idle model is unloaded first)."""
        self.last_used = time.monotonic()

    def may_retry(self) -> bool:
        """Whether a failed load is old enough to try again (sooner, its requests get its error)."""
        return time.monotonic() - self.opened_at >= RETRY_SECONDS
