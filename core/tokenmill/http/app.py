"""The Falcon ASGI app: TGI's and OpenAI's routes over the engine, the middleware, the error
handlers and the lifespan (load the model at start-up, stop the engine at shutdown).

A request flows: middleware (id, record, API key) → a route (``tgi/`` or ``openai/``) →
validation on the tokenizer thread → :class:`~tokenmill.http.generation.Generation` submits its
sequences to the engine → the engine writes their events into the request's token stream → the
route writes them out. A client that disconnects is noticed from the ASGI ``http.disconnect``
message and its sequences are cancelled at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import falcon
import falcon.asgi
import pluggy

from tokenmill.config import Config
from tokenmill.http.anthropic.routes import CountTokensRoute, MessagesRoute
from tokenmill.http.body import ApiError
from tokenmill.http.context import SCOPE_KEY, DisconnectWatch, request_scope
from tokenmill.http.generation import Generation
from tokenmill.http.holding import LoadingHold
from tokenmill.http.middleware import ApiKeyAuth, RequestContext, cors_middleware
from tokenmill.http.openai.routes import ChatCompletionsRoute, CompletionsRoute, ModelsRoute
from tokenmill.http.ops import (
    AdaptersRoute,
    HealthRoute,
    InfoRoute,
    MetricsRoute,
    ProfileRoute,
    QueueRoute,
    ResetPrefixCacheRoute,
)
from tokenmill.http.platform import InvocationsRoute, RootRoute, VersionRoute
from tokenmill.http.pooling.routes import (
    ClassifyRoute,
    EmbeddingsRoute,
    EmbedRoute,
    Pooling,
    RerankRoute,
    ScoreRoute,
)
from tokenmill.http.responses.routes import ResponsesRoute, StoredResponseRoute
from tokenmill.http.responses.store import ResponseStore
from tokenmill.http.sleep import IsSleepingRoute, SleepRoute, WakeUpRoute, sleep_when_idle
from tokenmill.http.state import ServerState
from tokenmill.http.tgi.routes import GenerateRoute
from tokenmill.http.tokens import ChatTokenizeRoute, DetokenizeRoute, TokenizerInfoRoute, TokenizeRoute
from tokenmill.observability.metrics import serve_metrics
from tokenmill.plugin_manager import build_plugin_manager

log = logging.getLogger(__name__)


def answer_api_error(resp: falcon.asgi.Response, error: ApiError) -> None:
    resp.status = falcon.code_to_http_status(error.status) if error.status != 499 else "499 Client Closed Request"
    resp.media = error.body()


def answer_http_error(req: falcon.asgi.Request, resp: falcon.asgi.Response, error: falcon.HTTPError) -> None:
    """Falcon's own errors (no route for the path, a method the route lacks, ...) with TGI's body too, in place
    of Falcon's ``{"title": ...}``; their headers (405's ``Allow``) are kept."""
    resp.status = error.status
    if error.headers:
        resp.set_headers(error.headers)
    if isinstance(error, falcon.HTTPNotFound):
        message, error_type = f"no route for {req.method} {req.path}", "not_found"
    elif isinstance(error, falcon.HTTPMethodNotAllowed):
        message, error_type = f"{req.method} is not allowed on {req.path}", "method_not_allowed"
    else:
        message, error_type = error.title or str(error.status), "http"
    message = error.description or message  # what a route (or a plugin's) that raised it says
    resp.media = {"error": message, "error_type": error_type}


class ErrorHandlers:
    """Every error is answered with TGI's body; a generation request that fails before it reached
    the engine (422, 429, 503, ...) is reported like one that failed in it."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def report(self, req: falcon.asgi.Request, message: str, error_type: str) -> None:
        record = request_scope(req).record if SCOPE_KEY in req.scope else None
        if record is not None:
            self.state.telemetry.request_failed(record, message, error_type)

    async def api_error(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, error: ApiError,
                        params: Any) -> None:
        answer_api_error(resp, error)
        self.report(req, error.message, error.error_type)

    async def http_error(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, error: falcon.HTTPError,
                         params: Any) -> None:
        answer_http_error(req, resp, error)
        self.report(req, resp.media["error"], resp.media["error_type"])

    async def unexpected(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, error: Exception,
                         params: Any) -> None:
        log.exception("unhandled error on %s %s", req.method, req.path)
        resp.status = falcon.HTTP_500
        resp.media = {"error": f"internal error: {type(error).__name__}", "error_type": "internal"}
        self.report(req, resp.media["error"], "internal")


class Lifespan:
    """Falcon lifespan middleware: at start-up (in the serving process, after gunicorn's fork) load
    the model in a thread and start the optional exporters; at shutdown stop them and the engine."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.metrics_server: Any = None

    async def process_startup(self, scope: Any, event: Any) -> None:
        config = self.state.config
        if config.allow_adapter_loading and not config.api_keys:
            log.warning("--allow-adapter-loading without --api-key: anyone who reaches port %d can load LoRA "
                        "adapters from %s", config.port, ", ".join(config.lora_adapter_dir) or "(no directory yet)")
        if config.otlp_endpoint:
            from tokenmill.observability.tracing import Tracing

            self.state.telemetry.tracing = Tracing.start(config.otlp_endpoint, config.otlp_service_name)
        if config.prometheus_port:
            self.metrics_server = serve_metrics(self.state.metrics, config.hostname, config.prometheus_port)
        threading.Thread(target=self.state.load_or_exit, name="tokenmill-loader", daemon=True).start()

    async def process_shutdown(self, scope: Any, event: Any) -> None:
        if self.state.engine is not None:
            await asyncio.to_thread(self.state.engine.stop)
        if self.state.pooler is not None:
            await asyncio.to_thread(self.state.pooler.stop)
        await asyncio.to_thread(self.state.stop_shards)
        self.state.workers.shutdown()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
        if self.state.telemetry.tracing is not None:
            await asyncio.to_thread(self.state.telemetry.tracing.shutdown)


def middleware(state: ServerState) -> list[Any]:
    """In order: CORS (answers preflights, and marks errors too), the API key, the request's id and record."""
    config = state.config
    chain: list[Any] = [Lifespan(state)]
    if config.cors_origins():
        chain.append(cors_middleware(config.cors_origins()))
    keys = config.api_keys
    if keys:  # before the request is counted: anyone without the key must not move the metrics
        chain.append(ApiKeyAuth(keys, config.priority_keys()))
    chain.append(RequestContext(state.telemetry, lambda: state.draining))
    return chain


def create_app(config: Config, pm: pluggy.PluginManager | None = None) -> DisconnectWatch:
    """The ASGI application for ``config``; the model loads when the server starts."""
    pm = pm or build_plugin_manager()
    for notice in config.notices:  # once per worker, now that its logging is set up
        log.warning(notice)
    state = ServerState(config, pm)
    app = falcon.asgi.App(middleware=middleware(state))
    generation = Generation(state)
    app.add_route("/generate", GenerateRoute(generation, stream=False))
    app.add_route("/generate_stream", GenerateRoute(generation, stream=True))
    health = HealthRoute(state)
    app.add_route("/", RootRoute(health, GenerateRoute(generation, stream=None)))
    app.add_route("/tokenize", TokenizeRoute(state))
    app.add_route("/health", health)
    app.add_route("/info", InfoRoute(state))
    app.add_route("/metrics", MetricsRoute(state))
    app.add_route("/queue", QueueRoute(state))
    app.add_route("/v1/chat/completions", ChatCompletionsRoute(generation))
    app.add_route("/v1/completions", CompletionsRoute(generation))
    app.add_route("/v1/models", ModelsRoute(state))
    responses = ResponseStore()
    app.add_route("/v1/responses", ResponsesRoute(generation, responses))
    app.add_route("/v1/responses/{response_id}", StoredResponseRoute(responses))
    app.add_route("/v1/messages", MessagesRoute(generation))
    app.add_route("/v1/messages/count_tokens", CountTokensRoute(state))
    pooling = Pooling(state)
    pooling_routes = {"/v1/embeddings": EmbeddingsRoute(pooling), "/embed": EmbedRoute(pooling),
                      "/rerank": RerankRoute(pooling), "/score": ScoreRoute(pooling),
                      "/classify": ClassifyRoute(pooling)}
    for path, route in pooling_routes.items():
        app.add_route(path, route)
    app.add_route("/v1/rerank", pooling_routes["/rerank"])
    app.add_route("/ping", health)  # SageMaker's name for the health check
    app.add_route("/invocations", InvocationsRoute(state, chat=ChatCompletionsRoute(generation),
                                                   completions=CompletionsRoute(generation),
                                                   generate=GenerateRoute(generation, stream=None),
                                                   pooling=pooling_routes))
    app.add_route("/chat_tokenize", ChatTokenizeRoute(state))
    app.add_route("/detokenize", DetokenizeRoute(state))
    app.add_route("/tokenizer_info", TokenizerInfoRoute(state))
    app.add_route("/version", VersionRoute())
    app.add_route("/adapters", AdaptersRoute(state))
    app.add_route("/reset_prefix_cache", ResetPrefixCacheRoute(state))
    app.add_route("/sleep", SleepRoute(state))
    app.add_route("/wake_up", WakeUpRoute(state))
    app.add_route("/is_sleeping", IsSleepingRoute(state))
    if config.sleep_after_idle and config.task == "generate":
        sleep_when_idle(state, config.sleep_after_idle)
    if config.enable_profiling:
        app.add_route("/debug/profile", ProfileRoute())
    errors = ErrorHandlers(state)
    app.add_error_handler(Exception, errors.unexpected)
    app.add_error_handler(ApiError, errors.api_error)
    app.add_error_handler(falcon.HTTPError, errors.http_error)
    pm.hook.tokenmill_add_routes(app=app, server=state)
    from tokenmill.http.openapi import add_document_routes  # the document lists the routes added above

    add_document_routes(app, config)
    return DisconnectWatch(LoadingHold(app, state) if config.hold_while_loading else app, state)
