"""Sleeping while idle: ``--sleep-after-idle SECONDS`` and vLLM's ``POST /sleep``, ``POST /wake_up`` and
``GET /is_sleeping``.

A sleeping engine has dropped its prefix cache and, on the paged backend on CPU, given its KV pool's memory
and its weights' back to the operating system (:meth:`tokenmill.engine.Engine.sleep`,
:mod:`tokenmill.model.offload`); it still serves: ``/health`` stays 200, and the next request wakes it (its
KV memory comes back as that request writes it, the weights as its forward reads them). A GPU's memory stays
allocated.
"""

from __future__ import annotations

import logging
import threading
import time

import falcon.asgi

from tokenmill.engine import Engine
from tokenmill.http.body import ApiError
from tokenmill.http.ops import engine_answer, refuse_cross_site
from tokenmill.http.state import ServerState

log = logging.getLogger(__name__)


class SleepRoute:
    """``POST /sleep`` (vLLM's route; its ``level`` is accepted, and every level frees the same: the prefix
    cache and, on the paged backend on CPU, the KV memory): 200 ``{"is_sleeping": true}``, or 409 while
    requests are live."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        refuse_cross_site(req, self.state.config.cors_origins())
        if not await engine_answer(self.state.ready_engine().sleep):
            raise ApiError(409, "requests are running: the server sleeps once they end", "busy")
        resp.media = {"is_sleeping": True}


class WakeUpRoute:
    """``POST /wake_up``: the engine is awake (its KV memory comes back as requests write it)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        refuse_cross_site(req, self.state.config.cors_origins())
        engine = self.state.ready_engine()
        self.state.last_request = time.monotonic()  # --sleep-after-idle counts from now
        engine.wake_up()
        resp.media = {"is_sleeping": False}


class IsSleepingRoute:
    """``GET /is_sleeping``: ``{"is_sleeping": bool}``."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.media = {"is_sleeping": self.state.ready_engine().asleep}


def sleep_when_idle(state: ServerState, seconds: float) -> None:
    """Start a thread that, once the model has loaded, puts the engine to sleep whenever no request has been
    open for ``seconds``."""

    def watch() -> None:
        while True:
            time.sleep(min(1.0, seconds / 4))
            engine = state.engine
            if engine is None and state.load_error is not None:
                return
            if engine is None:
                continue  # loading
            if not engine.healthy:
                return
            if not (engine.asleep or state.in_flight or time.monotonic() - state.last_request < seconds):
                _sleep_and_wait(engine, seconds)

    threading.Thread(target=watch, name="tokenmill-sleep", daemon=True).start()


def _sleep_and_wait(engine: Engine, idle: float) -> None:
    answered = threading.Event()

    def told(asleep: bool) -> None:
        log.info("no request for %gs: %s", idle, "asleep" if asleep else "requests came in meanwhile")
        answered.set()

    engine.sleep(told)
    answered.wait(60.0)
