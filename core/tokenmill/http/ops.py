"""The operational routes: /health /info /metrics /queue /adapters /reset_prefix_cache /debug/profile."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from collections.abc import Callable
from typing import Any, TypeVar

import falcon
import falcon.asgi

from tokenmill import __version__
from tokenmill.http.body import ApiError, cross_site_refusal, read_json
from tokenmill.http.schemas import ValidationError, check_body
from tokenmill.http.schemas.ops import LoadAdapterRequest
from tokenmill.http.state import ServerState, adapter_api_error
from tokenmill.model.adapters import AdapterCache
from tokenmill.model.hub import is_repo_id
from tokenmill.model.lora import AdapterBusy, AdapterError
from tokenmill.observability.profiling import MAX_SECONDS, ProfileError, record_flame_graph

T = TypeVar("T")


class MetricsRoute:
    """Prometheus text exposition: TGI's metric names and buckets (see ``tokenmill.observability.metrics``)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.content_type = "text/plain; version=0.0.4; charset=utf-8"
        resp.data = self.state.metrics.exposition()


class QueueRoute:
    """``GET /queue``: who waits and who runs, without prompt text."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        engine = self.state.ready_engine()
        view = engine.queue_view()
        resp.media = {"queue_size": len(view["pending"]), "batch_size": len(view["running"]),
                      "scheduler": self.state.config.scheduler, **view}


class AdaptersRoute:
    """``GET /adapters``: the LoRA adapters known and in memory. ``POST /adapters``
    ``{"id": ..., "path": ...}`` loads one while serving (behind ``--api-key``; ``path`` may be
    omitted for an id in the local Hugging Face cache)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.loading = asyncio.Lock()

    def cache(self) -> AdapterCache:
        self.state.ready_engine()
        if self.state.adapters is None:
            raise ApiError(404, "this server serves no LoRA adapters: start it with --lora-adapters or "
                                "--lora-cache-limit", "not_found")
        return self.state.adapters

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        cache = self.cache()
        resp.media = {"adapters": cache.names, **cache.usage()}

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        refuse_cross_site(req, self.state.config.cors_origins())
        cache = self.cache()
        config = self.state.config
        if not config.api_keys and not config.allow_adapter_loading:
            raise ApiError(403, "loading adapters at run time needs --api-key (or, on a trusted network, "
                                "--allow-adapter-loading)", "forbidden")
        try:
            request = check_body(LoadAdapterRequest, await read_json(req, config))
        except ValidationError as error:
            raise ApiError(422, f'{error} (the body is {{"id": "<name>", "path": "<PEFT adapter directory>"}})',
                           "validation") from None
        name = request.id
        source = allowed_adapter_path(name, request.path, config.lora_adapter_dir) if request.path is not None \
            else hub_only(name)
        try:  # one load at a time, on a thread of its own: a download never holds a validation worker
            async with self.loading:
                adapter = await asyncio.to_thread(cache.register, name, source)
        except (AdapterBusy, AdapterError) as error:
            raise adapter_api_error(error) from None
        resp.media = {"id": adapter.name, "rank": adapter.rank, "layers": len(adapter.layers),
                      "path": str(adapter.path)}


def refuse_cross_site(req: falcon.asgi.Request, cors_origins: tuple[str, ...]) -> None:
    """A 403 for a request that changes the server's state (an adapter, the prefix cache) from another
    site's web page (other than the origins ``--cors-allow-origin`` lists; its ``*`` trusts none here):
    without this, a page on the same network could do so with a "no-cors" POST."""
    why = cross_site_refusal(req, [origin for origin in cors_origins if origin != "*"])
    if why:
        raise ApiError(403, f"{req.method} {req.path} is refused: {why}", "forbidden")


async def engine_answer(ask: Callable[[Callable[[T], None]], None]) -> T:
    """What the engine thread tells the callback ``ask`` hands it (a chore's outcome), awaited on the event loop."""
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[T] = loop.create_future()
    ask(lambda outcome: loop.call_soon_threadsafe(answer.set_result, outcome))
    return await answer


def hub_only(name: str) -> str:
    """``name`` as a hub id to download; a body without ``path`` never reaches a local directory (only
    ``path`` does, inside ``--lora-adapter-dir``)."""
    if not is_repo_id(name) or os.path.exists(os.path.expanduser(name)):
        raise ApiError(403, f"adapter {name!r}: without `path`, POST /adapters loads a hub id (org/name) only; "
                            "give `path` inside a --lora-adapter-dir directory for a local adapter", "forbidden")
    return name


def allowed_adapter_path(name: str, path: str, directories: tuple[str, ...]) -> str:
    """``path`` (absolute, or relative to one of ``directories``) when it lies inside one of them, else a
    403 that names the adapter, not the path."""
    for directory in directories:
        root = os.path.realpath(directory)
        candidate = os.path.realpath(os.path.join(root, path))
        if os.path.commonpath([root, candidate]) == root and os.path.exists(candidate):
            return candidate
    if not directories:
        raise ApiError(403, f"adapter {name!r}: POST /adapters loads only from --lora-adapter-dir directories, "
                            "and the server has none", "forbidden")
    raise ApiError(403, f"adapter {name!r}: its path is not an adapter inside a --lora-adapter-dir directory",
                   "forbidden")


class ResetPrefixCacheRoute:
    """``POST /reset_prefix_cache`` (vLLM's route): drop every cached KV block that no sequence holds,
    between two engine steps. Behind ``--api-key``."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        refuse_cross_site(req, self.state.config.cors_origins())
        engine = self.state.ready_engine()
        dropped = await engine_answer(engine.reset_prefix_cache)
        resp.media = {"prefix_caching": self.state.prefix_caching_off is None, "dropped_blocks": dropped}


class HealthRoute:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        if self.state.draining:
            raise ApiError(503, "the server is shutting down", "unhealthy")
        self.state.check_ready()
        resp.status = falcon.HTTP_200
        resp.text = ""


PIPELINE_TAGS = {"generate": "text-generation", "embed": "feature-extraction", "score": "text-classification"}
"""/info's ``model_pipeline_tag`` per task: the hub's names, which TEI's /info gives too."""


class InfoRoute:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        state, config = self.state, self.state.config
        loaded, serving = state.loaded, state.serving
        resp.media = {
            "model_id": loaded.model_id if loaded else config.model_id,
            "model_sha": None,
            "model_dtype": str(loaded.dtype).replace("torch.", "") if loaded else config.dtype,
            "model_dtype_reason": loaded.dtype_reason if loaded else None,
            "quantize": loaded.quantization if loaded else config.quantize,
            "num_shard": config.num_shard,
            "model_device_type": loaded.device.type if loaded else None,
            "model_pipeline_tag": ("image-text-to-text" if loaded and loaded.processor is not None
                                   else PIPELINE_TAGS.get(config.task, "text-generation")),
            "task": config.task,
            "max_concurrent_requests": config.max_concurrent_requests,
            "max_best_of": config.max_best_of,
            "max_stop_sequences": config.max_stop_sequences,
            "max_input_tokens": config.max_input_tokens,
            "max_total_tokens": config.max_total_tokens,
            "max_batch_prefill_tokens": config.max_batch_prefill_tokens,
            "max_batch_total_tokens": config.max_batch_total_tokens,
            "max_batch_size": config.max_batch_size,
            "max_top_n_tokens": config.max_top_n_tokens,
            "validation_workers": config.validation_workers,
            "max_client_batch_size": config.max_client_batch_size,
            "takes_images": bool(loaded and loaded.processor is not None),
            "max_images": config.max_images if loaded and loaded.processor is not None else 0,
            "speculate": config.speculate,
            "router": "tokenmill",
            "version": __version__,
            "sha": None,
            "docker_label": os.environ.get("DOCKER_LABEL"),
            "backend": state.chosen.backend.name if state.chosen else config.backend,
            "attention": plugin_name(state.chosen.attention) if state.chosen else config.attention,
            "scheduler": config.scheduler,
            "kv_allocator": plugin_name(state.chosen.kv_allocator) if state.chosen else config.kv_allocator,
            "block_size": (state.chosen.block_size
                           if state.chosen and state.chosen.backend.kv_layout == "paged" else None),
            "prefix_caching": state.engine is not None and state.prefix_caching_off is None,
            "prefix_caching_off_reason": state.prefix_caching_off,
            "kv": state.engine.kv_usage() if state.engine else None,
            "tool_call_parser": state.chat_format.tool_parser.name if state.chat_format else config.tool_call_parser,
            "reasoning_parser": config.reasoning_parser,
            "lora_adapters": state.adapters.names if state.adapters is not None else None,
            "ready": serving is not None and serving.healthy,
            "load_stage": "ready" if serving is not None else (state.stages.current or "starting"),
            "load_stages": [{**stage, "detail": without_directories(stage["detail"])} for stage in state.stages.done],
            "forward": state.compiler.forward if state.compiler is not None else None,
            "forward_from_cache": state.compiler.from_cache if state.compiler is not None else None,
            "sleeping": state.engine.asleep if state.engine is not None else False,
            "queue_size": serving.queue_size if serving else 0,
            "batch_size": serving.batch_size if serving else 0,
        }


ABSOLUTE_PATH = re.compile(r"(?<![\w.:/])/(?:[^\s/()]+/)*([^\s/()]*)")


def without_directories(text: str) -> str:
    """``text`` with each absolute path cut to its last part: /info tells no one where the server keeps
    its files (the log, which only the operator reads, has them whole)."""
    return ABSOLUTE_PATH.sub(r"\1", text)


def plugin_name(chosen: Any) -> str | None:
    """A chosen plugin's name; None where the backend's own engine does that part."""
    return chosen.name if chosen is not None else None


class ProfileRoute:
    """Samples every thread of the server (the engine's forward included, and threads that wait:
    an idle server still gives a graph) for ``seconds`` (1-60, default 10) and answers the SVG.
    One profile at a time."""

    def __init__(self) -> None:
        self.busy = asyncio.Lock()

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        py_spy = shutil.which("py-spy")
        if py_spy is None:
            raise ApiError(501, "profiling needs py-spy: pip install 'tokenmill[profile]'", "unavailable")
        try:
            seconds = int(req.get_param("seconds") or 10)
        except ValueError:
            raise ApiError(422, "seconds must be a whole number", "validation") from None
        if not 1 <= seconds <= MAX_SECONDS:
            raise ApiError(422, f"seconds must be between 1 and {MAX_SECONDS} (got {seconds})", "validation")
        if self.busy.locked():
            raise ApiError(429, "a profile is being recorded already", "overloaded")
        async with self.busy:
            try:
                resp.data = await record_flame_graph(py_spy, seconds)
            except ProfileError as error:
                raise ApiError(500, str(error), "profiling") from None
        resp.content_type = "image/svg+xml"
