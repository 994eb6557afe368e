"""The several-model server's ASGI app: each request goes to the app of the model it names.

A request names its model by the ``x-model`` header (TGI's routes), else by its JSON body's ``model`` (OpenAI's
and Anthropic's), else it goes to the default model (the first). A model that is not loaded is loaded for it:
while it loads, requests to the routes that run the model are held by its app (``--hold-while-loading``) and the
others wait here. With ``--max-loaded-models`` loaded, the least recently used model that has no request open is
unloaded first; when every loaded one is busy the request gets 429. ``/health``, ``/ping``, ``/v1/models`` and
``/metrics`` are the router's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pluggy

from tokenmill.config import Config, ConfigError
from tokenmill.http.body import ApiError
from tokenmill.http.holding import HELD_PATHS, Receive, Send, body_object, loaded, read_body, replay
from tokenmill.http.middleware import UNAUTHORIZED, ApiKeyAuth, open_route
from tokenmill.http.router.catalog import model_config, served_models
from tokenmill.http.router.routes import RouterMetrics, own_routes
from tokenmill.http.router.served import ServedModel
from tokenmill.observability.metrics import serve_metrics
from tokenmill.plugin_manager import build_plugin_manager

log = logging.getLogger(__name__)

OWN_PATHS = frozenset({"/health", "/ping", "/v1/models", "/metrics"})


class ModelRouter:
    """ASGI app serving several models, each loaded on demand (see the module's docstring)."""

    def __init__(self, config: Config, pm: pluggy.PluginManager | None = None) -> None:
        self.config = config
        self.pm = pm or build_plugin_manager()
        self.models: dict[str, ServedModel] = {}
        self._find_models()
        self.default = next(iter(self.models))
        self.switch = asyncio.Lock()
        """Held while a model is chosen, loaded or unloaded."""
        self.draining = False
        self.state = self  # what the server's graceful stop reads: ``config`` and ``drain``
        self.auth = ApiKeyAuth(config.api_keys) if config.api_keys else None
        self.own = own_routes(self)
        self.metrics_server: Any = None
        for notice in config.notices:
            log.warning(notice)

    def _find_models(self) -> None:
        """The models the flags and ``--models-dir`` name now (a checkpoint added to the directory later is
        found when a request first names it)."""
        for name, model_id in served_models(self.config).items():
            if name not in self.models:
                self.models[name] = ServedModel(name, model_config(self.config, name, model_id), self.pm)

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http" and (scope["path"] in OWN_PATHS or (
                scope["path"] == "/" and scope["method"] in ("GET", "HEAD"))):  # TGI's health check
            await self.own(scope, receive, send)
        elif scope["type"] == "http":
            await self._forward(scope, receive, send)

    async def _forward(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        keyed = self.auth is None or self.auth.match(headers.get("authorization"), headers.get("x-api-key")) is not None
        if not keyed and not open_route(scope["path"], scope["method"], "access-control-request-method" in headers):
            await answer(send, ApiError(401, UNAUTHORIZED, "authentication"))
            return
        name = headers.get("x-model")
        if name is None and scope["method"] == "POST":
            read = await read_body(receive, self.config)
            if read.ended:
                return
            receive = replay(read.messages, receive)
            name = body_model(read.body) if read.whole else None
        try:
            served = self._named(name or self.default)
            if not keyed and served.status not in ("loading", "loaded"):  # only a request with the key loads one
                raise ApiError(401, UNAUTHORIZED, "authentication")
            app = await self._take(served)
        except ApiError as error:
            await answer(send, error)
            return
        try:
            if not (scope["method"] == "POST" and scope["path"] in HELD_PATHS):  # those its app holds, with heartbeats
                while not loaded(app.state):
                    await asyncio.sleep(0.05)
            await app(scope, receive, send)
        finally:
            served.open -= 1
            served.touch()

    def _named(self, name: str) -> ServedModel:
        if name not in self.models and self.config.models_dir:
            with contextlib.suppress(ConfigError, OSError):  # the directory emptied or gone: the known models stay
                self._find_models()
        if name not in self.models:
            raise ApiError(404, f"the model '{name}' is not served here; GET /v1/models lists those that are",
                           "not_found")
        return self.models[name]

    async def _take(self, served: ServedModel) -> Any:
        """The model's app, loading it (after unloading another to make room) when it is not loaded, with the
        request counted as open on it."""
        if self.draining:
            raise ApiError(503, "the server is stopping", "unhealthy")
        if served.status in ("loading", "loaded"):  # no wait for another model's load or unload
            served.open += 1
            served.touch()
            return served.app
        return await self._load(served)

    async def _load(self, served: ServedModel) -> Any:
        async with self.switch:
            if served.status == "failed" and served.open == 0 and served.may_retry():
                await served.close()  # its last load failed a while ago: try again
            if served.app is None:
                await self._make_room()
                await served.open_app()
            served.open += 1
            served.touch()
            return served.app

    async def _make_room(self) -> None:
        loaded_models = [served for served in self.models.values() if served.app is not None]
        while len(loaded_models) >= self.config.max_loaded_models:
            idle = [served for served in loaded_models if served.evictable]
            if not idle:
                raise ApiError(429, f"all {len(loaded_models)} loaded models are busy (--max-loaded-models "
                                    f"{self.config.max_loaded_models}): try again", "overloaded")
            oldest = min(idle, key=lambda served: served.last_used)
            await oldest.close()
            loaded_models.remove(oldest)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                if self.config.prometheus_port:
                    self.metrics_server = serve_metrics(RouterMetrics(self), self.config.hostname,
                                                        self.config.prometheus_port)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                async with self.switch:
                    await asyncio.gather(*(served.close() for served in self.models.values()))
                if self.metrics_server is not None:
                    self.metrics_server.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def drain(self, grace: float, now: asyncio.Event) -> None:
        """SIGTERM: every loaded model drains (see :meth:`ServerState.drain`); no model loads any more."""
        self.draining = True
        states = [served.state for served in self.models.values() if served.state is not None]
        await asyncio.gather(*(state.drain(grace, now) for state in states))


def body_model(body: bytes) -> str | None:
    """A JSON body's ``model`` (None for a body without one, or no JSON object)."""
    model = body_object(body).get("model")
    return model if isinstance(model, str) and model else None


async def answer(send: Callable[[dict[str, Any]], Awaitable[None]], error: ApiError) -> None:
    """An error answered here, with TGI's body."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
