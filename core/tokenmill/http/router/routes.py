"""The several-model server's own routes: ``/health`` and ``/ping`` (200 while it can serve: a model not loaded
is loaded when asked for), ``/v1/models`` (every model, with its state) and ``/metrics`` (the loaded models',
each sample labelled ``model``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import falcon
import falcon.asgi

from tokenmill.http.app import answer_api_error, answer_http_error
from tokenmill.http.body import ApiError
from tokenmill.observability.labelled import merge_expositions

if TYPE_CHECKING:
    from tokenmill.http.router.router import ModelRouter

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class RouterHealth:
    """``GET /health`` (``/ping``, ``GET /``): 200 while the server can serve, 503 once it drains."""

    def __init__(self, router: ModelRouter) -> None:
        self.router = router

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        if self.router.draining:
            raise ApiError(503, "the server is shutting down", "unhealthy")
        resp.text = ""

    on_head = on_get


class RouterModels:
    """``GET /v1/models``: OpenAI's list, each model with llama.cpp's router ``status`` (``{"value": "loaded"}``,
    ``loading``, ``unloaded`` or ``failed``)."""

    def __init__(self, router: ModelRouter) -> None:
        self.router = router

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        created = int(time.time())
        resp.media = {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "tokenmill",
             "status": {"value": served.status}}
            for name, served in self.router.models.items()]}


class RouterMetrics:
    """``GET /metrics``: every loaded model's metrics, labelled with its name."""

    def __init__(self, router: ModelRouter) -> None:
        self.router = router

    def exposition(self) -> bytes:
        states = {name: served.state for name, served in list(self.router.models.items())}
        parts = {name: state.metrics.exposition() for name, state in states.items() if state is not None}
        return merge_expositions("model", parts)

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.content_type = METRICS_CONTENT_TYPE
        resp.data = self.exposition()


async def error_body(req: falcon.asgi.Request, resp: falcon.asgi.Response, error: Exception, params: Any) -> None:
    """Errors with TGI's body, as the one-model app answers them."""
    if isinstance(error, ApiError):
        answer_api_error(resp, error)
    elif isinstance(error, falcon.HTTPError):
        answer_http_error(req, resp, error)
    else:
        raise error


def own_routes(router: ModelRouter) -> falcon.asgi.App:
    """The Falcon app of the router's own routes."""
    app = falcon.asgi.App()
    health = RouterHealth(router)
    app.add_route("/health", health)
    app.add_route("/ping", health)
    app.add_route("/", health)
    app.add_route("/v1/models", RouterModels(router))
    app.add_route("/metrics", RouterMetrics(router))
    app.add_error_handler(ApiError, error_body)
    app.add_error_handler(falcon.HTTPError, error_body)
    return app
