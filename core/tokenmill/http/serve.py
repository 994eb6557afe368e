"""Running the ASGI app: gunicorn with one uvicorn worker (production) or uvicorn alone, both
with the same graceful stop.

SIGTERM (or SIGINT) starts a drain instead of uvicorn's immediate close: the listener stays open
so that new requests get a 503 and /health says 503 (the load balancer takes the pod out), the
requests in flight finish within ``--graceful-termination-timeout``, the rest are then ended with
an error (a stream's last event), and the process exits 0. A second signal ends them at once.

A signal sent to the whole process group (systemd's default KillMode, Ctrl-C in a terminal, ``tini
-g``) reaches the worker twice: directly, and forwarded by the gunicorn master a moment later. So a
signal within :data:`REPEAT_SECONDS` of the one before is the same signal; only a deliberate second
one, later, counts as "again".

In the container, ``image/entrypoint.sh`` execs gunicorn with ``image/gunicorn.conf.py``, which
takes its settings from :func:`gunicorn_options`, as ``tokenmill launch`` does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from types import FrameType
from typing import Any

import uvicorn
from uvicorn_worker import UvicornWorker

from tokenmill.config import Config, parse_config
from tokenmill.http.app import ServerState, create_app
from tokenmill.http.connections import connection_settings
from tokenmill.model import collector, kv_memory
from tokenmill.observability.logs import gunicorn_logconfig

log = logging.getLogger(__name__)

ARGS_VARIABLE = "TOKENMILL_ARGS"
"""The container's command-line flags, as a JSON list, from the entrypoint to gunicorn's worker."""

SHUTDOWN_MARGIN_SECONDS = 30
"""gunicorn waits this much longer than the drain before it kills the worker: enough for the
engine's last step, the requests' error answers, uvicorn closing connections and the lifespan
shutdown (see ``server.ENGINE_STOP_SECONDS``)."""


REPEAT_SECONDS = 2.0
"""Signals this close together are one signal delivered twice (to the group, and forwarded)."""


class DrainingServer(uvicorn.Server):
    """uvicorn's server with tokenmill's graceful stop (see the module's docstring)."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.drain_task: asyncio.Task[None] | None = None
        self.stop_now = asyncio.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.last_signal = -REPEAT_SECONDS

    async def serve(self, sockets: list[Any] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # uvicorn's own handler records the signal to raise it again on exit (so the process would
        # die of it): a drained server exits 0 instead. Signal handlers run on the loop's thread
        # between its callbacks, so hand the work to the loop, with the time the signal arrived (the
        # loop may run the callback late, and two signals must not look closer than they were).
        if self.loop is None:
            self.should_exit = True
            return
        self.loop.call_soon_threadsafe(self.on_signal, sig, time.monotonic())

    def on_signal(self, sig: int, arrived: float) -> None:
        repeated, self.last_signal = arrived - self.last_signal < REPEAT_SECONDS, arrived
        if repeated:
            log.info("%s: the same stop, delivered twice (to the process group)", signal.Signals(sig).name)
            return
        if self.drain_task is None:
            log.info("%s: stopping gracefully", signal.Signals(sig).name)
            self.drain_task = asyncio.ensure_future(self.drain_then_exit())
        elif not self.stop_now.is_set():
            log.info("%s again: ending the requests in flight now", signal.Signals(sig).name)
            self.stop_now.set()
        else:
            self.force_exit = True

    def end_now(self) -> None:
        """gunicorn's fast shutdown (SIGQUIT): no grace period."""
        self.stop_now.set()
        if self.drain_task is None:
            self.drain_task = asyncio.ensure_future(self.drain_then_exit())

    async def drain_then_exit(self) -> None:
        try:
            await self.state.drain(self.state.config.graceful_termination_timeout, self.stop_now)
        finally:
            self.should_exit = True


KEEPALIVE_SECONDS = 75
"""How long an idle kept-alive connection stays open: longer than load balancers' usual idle timeout (60 s)
and than clients' pools keep one (httpx: 5 s), so that the client closes first. At uvicorn's own 5 s, a
client reusing a connection just as the server closed it got no answer (3 of 3,000 in a soak)."""


def uvicorn_config(app: Any, config: Config) -> uvicorn.Config:
    return uvicorn.Config(app, host=config.hostname, port=config.port, log_config=None,
                          timeout_graceful_shutdown=5, lifespan="on", timeout_keep_alive=KEEPALIVE_SECONDS,
                          **connection_settings(config))


def server_app(config: Config) -> Any:
    """The ASGI app that serves ``config``: one model's, or the router over several."""
    if config.serves_several():
        from tokenmill.http.router.router import ModelRouter

        return ModelRouter(config)
    return create_app(config)


def serve(config: Config) -> int:
    if config.server == "uvicorn":
        app = server_app(config)
        DrainingServer(uvicorn_config(app, config), app.state).run()  # type: ignore[attr-defined]
        return 0
    return _serve_gunicorn(config)


class TokenmillWorker(UvicornWorker):
    """gunicorn's uvicorn worker running :class:`DrainingServer`."""

    CONFIG_KWARGS: dict[str, Any] = {"loop": "auto", "http": "auto", "lifespan": "on", "timeout_graceful_shutdown": 5}

    async def _serve(self) -> None:
        from gunicorn.arbiter import Arbiter

        self.config.app = self.wsgi
        server = DrainingServer(self.config, self.wsgi.state)
        asyncio.get_running_loop().add_signal_handler(signal.SIGQUIT, server.end_now)
        await server.serve(sockets=self.sockets)
        if not server.started:
            sys.exit(Arbiter.WORKER_BOOT_ERROR)


def gunicorn_options(config: Config) -> dict[str, Any]:
    """gunicorn's settings for ``config``: one worker owns the model; its heartbeat timeout only
    catches a stuck event loop (loading and generating run in other threads); gunicorn's graceful
    timeout outlasts the drain so that it never kills a draining worker."""
    host = f"[{config.hostname}]" if ":" in config.hostname else config.hostname
    return {
        "bind": [f"{host}:{config.port}"],
        "workers": 1,
        "worker_class": "tokenmill.http.serve.TokenmillWorker",
        "timeout": 120,
        "graceful_timeout": config.graceful_termination_timeout + SHUTDOWN_MARGIN_SECONDS,
        "keepalive": KEEPALIVE_SECONDS,
        "accesslog": None,
        "loglevel": "info",
        "logconfig_dict": gunicorn_logconfig(config.json_output),
        "when_ready": forward_second_sigterm,
        **fork_hooks(config),
    }


def fork_hooks(config: Config) -> dict[str, Any]:
    """gunicorn hooks around forking the worker, for the full collections ``tokenmill launch`` held back
    (:mod:`~tokenmill.model.collector`): the master, started, freezes what it imported and lets them run (it watches
    its worker for months); a worker that loads its model at start holds them back again until that start
    ends. A router's worker loads models later: it does not."""
    def pre_fork(arbiter: Any, worker: Any) -> None:
        kv_memory.freeze_start_heap()

    def post_fork(arbiter: Any, worker: Any) -> None:
        if not config.serves_several():
            collector.hold_full_collections()

    return {"pre_fork": pre_fork, "post_fork": post_fork}


def forward_second_sigterm(arbiter: Any) -> None:
    """gunicorn hook: a second SIGTERM to gunicorn reaches the worker (which then ends its requests
    now); gunicorn itself ignores signals while it waits for its worker to stop."""
    first = signal.getsignal(signal.SIGTERM)
    stopping = False

    def on_sigterm(sig: int, frame: FrameType | None) -> None:
        nonlocal stopping
        if stopping:
            arbiter.kill_workers(signal.SIGTERM)
            return
        stopping = True
        if callable(first):
            first(sig, frame)

    signal.signal(signal.SIGTERM, on_sigterm)


def config_from_environment() -> Config:
    """The configuration of a gunicorn-run server: environment variables, and the container's flags
    in ``TOKENMILL_ARGS`` (raises ConfigError)."""
    return parse_config(json.loads(os.environ.get(ARGS_VARIABLE) or "[]"))


def app_from_environment() -> Any:
    """gunicorn's app factory (``tokenmill.http.serve:app_from_environment()``), called in the worker
    (logging is set up by gunicorn's ``logconfig_dict``)."""
    return server_app(config_from_environment())


def _serve_gunicorn(config: Config) -> int:
    from gunicorn.app.base import BaseApplication

    # Set before gunicorn forks its worker, which builds its uvicorn settings from them.
    TokenmillWorker.CONFIG_KWARGS = {**TokenmillWorker.CONFIG_KWARGS, **connection_settings(config)}

    class TokenmillApplication(BaseApplication):  # type: ignore[misc]
        def load_config(self) -> None:
            for key, value in gunicorn_options(config).items():
                self.cfg.set(key, value)

        def load(self) -> Any:
            # Built in the worker after the fork; the engine thread starts at lifespan start-up.
            return server_app(config)

    TokenmillApplication().run()
    return 0
