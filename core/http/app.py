"""The Falcon ASGI app: TGI's HTTP routes over the engine.

Handlers validate, hand the request to the engine, and relay its events. The
engine thread pushes events into a per-request asyncio queue through
``call_soon_threadsafe``; a client that disconnects is noticed from the ASGI
``http.disconnect`` message and its sequence is cancelled at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from dataclasses import dataclass, replace
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Awaitable, Callable

import falcon
import falcon.asgi
import pluggy

from tokenmill import __version__
from tokenmill.model import sharding
from tokenmill.config import Config
from tokenmill.engine.engine import Engine
from tokenmill.http.body import ApiError, read_json
from tokenmill.model.loading import LoadedModel, ModelLoadError, Stages
from tokenmill.model.lora import Adapter, AdapterBusy, AdapterCache, AdapterError
from tokenmill.observability.metrics import Metrics, serve_metrics
from tokenmill.http.middleware import ApiKeyAuth, RequestContext, cors_middleware
from tokenmill.http.openai import (
    ChatCompletionsRoute,
    CompletionsRoute,
    ModelsRoute,
    OpenAIJob,
    OpenAIStream,
    sse_events,
)
from tokenmill.plugin_manager import Chosen, build_plugin_manager
from tokenmill.observability.profiling import ProfileRoute
from tokenmill.engine.sequence import PRIORITY_CLASSES, ErrorEvent, Event, FinalResult, GenerationRequest, Sequence, TokenEvent
from tokenmill.model.sharding import ShardProcesses
from tokenmill.engine.startup import start_engine
from tokenmill.observability.telemetry import RequestRecord, Telemetry
from tokenmill.http.validation import ValidationError, Validator, parse_body

log = logging.getLogger(__name__)

DISCONNECTED = object()

ENGINE_STOP_SECONDS = 10.0
"""After the grace period: how long the engine's current step may take to end."""
ANSWER_SECONDS = 5.0
"""... and how long the requests then get to write their error. With uvicorn's own 5 s for
connections this bounds the time after the grace period (``serve.SHUTDOWN_MARGIN_SECONDS``)."""


class Slot:
    """One of the ``--max-concurrent-requests`` places, with the LoRA adapter its request pinned;
    giving it back (once, whatever the path) unpins the adapter too."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.held = True
        self.adapter: Adapter | None = None

    def release(self) -> None:
        if self.held:
            self.held = False
            self.state.in_flight -= 1
            if self.adapter is not None and self.state.adapters is not None:
                self.state.adapters.release(self.adapter)


class ServerState:
    """Everything the routes share: config, plugins, the loaded model and the engine."""

    def __init__(self, config: Config, pm: pluggy.PluginManager) -> None:
        self.config = config
        self.pm = pm
        self.stages = Stages(observer=lambda stage, seconds, detail: pm.hook.tokenmill_load_stage(
            stage=stage, seconds=seconds, detail=detail))
        self.loaded: LoadedModel | None = None
        self.validator: Validator | None = None
        self.engine: Engine | None = None
        self.shards: ShardProcesses | None = None
        """The other ranks, when this process started them (``--num-shard`` without torchrun)."""
        self.shard_failure: str | None = None
        self.shards_stopping = False
        self.chosen: Chosen | None = None
        self.adapters: AdapterCache | None = None
        """The LoRA adapters (with --lora-adapters or --lora-cache-limit)."""
        self.prefix_caching_off: str | None = None
        """Once loaded: why prompts' computed prefixes are not reused, or None when they are."""
        self.vocab_size = 0
        self.in_flight = 0
        self.draining = False
        """Set by SIGTERM: /health and new requests say 503 while those in flight finish."""
        self.metrics = Metrics(self.live_snapshot)
        self.telemetry = Telemetry(self.metrics)
        # Tokenizing a long prompt takes milliseconds: do it off the event loop, on one thread
        # because a fast tokenizer must not be used from two threads at once.
        self.tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-tokenizer")

    # ---- loading (runs in its own thread so /health answers meanwhile) ----------------

    def load(self) -> None:
        if self.config.num_shard > 1 and "RANK" not in os.environ:  # torchrun starts the other ranks itself
            self.shards = ShardProcesses(self.config)
            threading.Thread(target=self._watch_shards, name="tokenmill-shards", daemon=True).start()
        started = start_engine(self.config, self.pm, self.stages, on_chosen=self._set_chosen)
        self.loaded, self.vocab_size, self.adapters = started.loaded, started.vocab_size, started.adapters
        self.prefix_caching_off = started.prefix_caching_off
        adapters = started.adapters
        self.validator = Validator(started.loaded.tokenizer, self.config, started.vocab_size,
                                   adapter_names=(lambda: adapters.names) if adapters is not None else None,
                                   model_id=started.loaded.model_id, refusal=started.engine.refusal)
        assert self.config.max_input_tokens and self.config.max_total_tokens
        self.metrics.set_token_limits(self.config.max_input_tokens, self.config.max_total_tokens)
        started.engine.step_observer = self.metrics.step_finished
        started.engine.start()
        self.engine = started.engine

    def _watch_shards(self) -> None:
        """Start the other ranks, then watch them: a shard that ends ends the server. /health says 503 at
        once, the process exits a moment later (exit status 3, which also stops gunicorn instead of
        restarting the worker). The shards are started from this thread because it lives as long as
        the process: Linux ends them when the thread that started them ends."""
        assert self.shards is not None
        self.shards.start()
        while self.shard_failure is None and not self.shards_stopping:
            ended = self.shards.first_exit()
            if ended is not None:
                rank, code = ended
                self.shard_failure = f"shard {rank} of {self.config.num_shard} exited with status {code}"
                log.error("%s; the server stops", self.shard_failure)
                time.sleep(1.0)
                self.shards.stop(timeout=2.0)
                logging.shutdown()
                os._exit(3)
            time.sleep(0.2)

    def stop_shards(self) -> None:
        """Tell the shards to end (when the engine has stopped), then make sure they did."""
        self.shards_stopping = True  # shards that now exit 0 are not a failure
        if self.config.num_shard > 1 and self.engine is not None and self.shard_failure is None:
            def tell_and_leave() -> None:
                sharding.broadcast(sharding.STOP)
                sharding.leave_group()

            sender = threading.Thread(target=tell_and_leave, daemon=True)
            sender.start()
            sender.join(5.0)
        if self.shards is not None:
            self.shards.stop()

    def _set_chosen(self, chosen: Chosen) -> None:
        self.chosen = chosen

    def load_or_exit(self) -> None:
        try:
            self.load()
        except Exception as error:  # noqa: BLE001 - report one line, then stop the process
            message = str(error) if isinstance(error, ModelLoadError) else f"{type(error).__name__}: {error}"
            log.error("startup failed: %s", message)
            logging.shutdown()
            os._exit(3)  # gunicorn treats 3 as "worker failed to boot" and stops instead of retrying

    def ready_engine(self) -> Engine:
        if self.shard_failure is not None:
            raise ApiError(503, f"the server is stopping: {self.shard_failure}", "unhealthy")
        if self.engine is None:
            stage = self.stages.current or "starting"
            raise ApiError(503, f"the model is not ready yet ({stage})", "unhealthy")
        if not self.engine.healthy:
            raise ApiError(503, "the engine has stopped", "unhealthy")
        return self.engine

    async def drain(self, grace: float, now: asyncio.Event) -> None:
        """SIGTERM: refuse new requests (503) and let those in flight finish, for up to ``grace`` seconds
        or until ``now`` is set (a second signal); then end the rest with an error (a stream's last
        event) and wait until their responses are written."""
        self.draining = True
        telemetry = self.telemetry
        log.info("draining: %d requests in flight, up to %gs to finish", telemetry.open_requests, grace)
        deadline = time.monotonic() + grace
        while telemetry.open_requests and not now.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if telemetry.open_requests and self.engine is not None:
            log.warning("ending %d requests still in flight", telemetry.open_requests)
            await asyncio.to_thread(self.engine.stop, ENGINE_STOP_SECONDS)
            deadline = time.monotonic() + ANSWER_SECONDS
            while telemetry.open_requests and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        log.info("drained")

    def live_snapshot(self) -> dict[str, Any]:
        """What the gauges of /metrics read at scrape time (empty while loading)."""
        engine = self.engine
        if engine is None:
            return {}
        view = engine.queue_view()
        return {
            "queue_size": engine.queue_size,
            "batch_size": engine.batch_size,
            "batch_max_tokens": sum(entry["prompt_tokens"] + entry["max_new_tokens"] for entry in view["running"]),
            "in_flight": self.in_flight,
            "queue_by_class": {name: sum(1 for entry in view["pending"] if entry["priority"] == name)
                               for name in PRIORITY_CLASSES},
            "kv": engine.runner.kv_usage(),
            "lora": self.adapters.usage() if self.adapters is not None else None,
            "preemptions": engine.preemptions,
            "suspensions": engine.suspensions,
            "prefix_cache": {"queried_tokens": engine.prefix_queried_tokens, "hit_tokens": engine.prefix_hit_tokens}
            if engine.prefix_caching else None,
        }

    def take_slot(self) -> Slot:
        if self.in_flight >= self.config.max_concurrent_requests:
            raise ApiError(429, "Model is overloaded", "overloaded")
        self.in_flight += 1
        return Slot(self)


# ---- request plumbing ------------------------------------------------------------------


class Channel:
    """The thread-safe hand-off of one sequence's events from the engine to the event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.emitted = 0
        """Events the engine handed over (written by the engine thread only)."""
        self.delivered = 0
        """Events written to the client (by the event loop only)."""

    def sink(self, event: Event) -> None:
        self.emitted += 1
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    def backlog(self) -> int:
        """Events not yet written to the client: a slow reader's grows until its sequence pauses."""
        return self.emitted - self.delivered

    def disconnected(self) -> None:
        self.queue.put_nowait(DISCONNECTED)


def with_header_priority(req: falcon.asgi.Request, params: dict[str, Any]) -> dict[str, Any]:
    """The ``X-Priority`` header sets the ``priority`` parameter when the body does not."""
    header_priority = req.get_header("X-Priority")
    if header_priority is not None and "priority" not in params:
        return {**params, "priority": header_priority.strip().lower()}
    return params


def on_disconnect(req: falcon.asgi.Request, callback: Callable[[], None]) -> None:
    req.scope["tokenmill.on_disconnect"].append(callback)


def cancel_on_disconnect(engine: Engine, seq: Sequence, channel: Channel) -> Callable[[], None]:
    """A disconnect callback that cancels ``seq`` and wakes whoever waits on ``channel``."""
    def cancel() -> None:
        engine.cancel(seq)
        channel.disconnected()

    return cancel


async def watch_receive(req: falcon.asgi.Request) -> None:
    """Read the ASGI channel after the body so that a client that leaves is noticed."""
    receive = req.scope["tokenmill.receive"]
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class DisconnectWatch:
    """ASGI wrapper: tells registered callbacks the moment ``http.disconnect`` arrives, and reports
    a generation request whose handling ended without reporting it (its task was cancelled)."""

    def __init__(self, app: Callable[..., Awaitable[None]], state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Awaitable[Any]], send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        callbacks: list[Callable[[], None]] = []

        async def watched_receive() -> Any:
            message = await receive()
            if message["type"] == "http.disconnect":
                for callback in callbacks:
                    callback()
                callbacks.clear()
            return message

        scope["tokenmill.on_disconnect"] = callbacks
        scope["tokenmill.receive"] = watched_receive
        scope["tokenmill.state"] = self.state
        try:
            await self.app(scope, watched_receive, send)
        finally:
            record = scope.get("tokenmill.record")
            if record is not None:
                self.state.telemetry.request_failed(record, "the request ended without an answer", "cancelled")


# ---- JSON shapes (TGI's) --------------------------------------------------------------


def per_prompt(requests: list[GenerationRequest], counts: list[int]) -> int:
    """The sum of ``counts`` over the distinct requests (the choices of one prompt count once)."""
    seen: dict[int, int] = {}
    for request, count in zip(requests, counts):
        seen.setdefault(id(request), count)
    return sum(seen.values())


def details_json(result: FinalResult, with_top: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "finish_reason": result.finish_reason,
        "generated_tokens": result.generated_tokens,
        "seed": result.seed,
        "prefill": [{"id": t.id, "text": t.text, "logprob": t.logprob} for t in result.prefill],
        "tokens": [t.as_json() for t in result.tokens],
    }
    if with_top:
        body["top_tokens"] = [[t.as_json() for t in step] for step in result.top_tokens]
    return body


def timing_headers(resp: falcon.asgi.Response, record: RequestRecord, request: GenerationRequest, device: str) -> None:
    """TGI's response headers of a whole (not streamed) response: times in milliseconds but
    ``x-compute-time``, in seconds."""
    total = time.monotonic() - record.started_monotonic
    resp.set_headers({
        "x-compute-type": device,
        "x-compute-time": f"{total:.6f}",
        "x-compute-characters": str(len(request.inputs)),
        "x-total-time": str(int(total * 1000)),
        "x-validation-time": str(int(record.validation_seconds * 1000)),
        "x-queue-time": str(int(record.queue_seconds * 1000)),
        "x-inference-time": str(int(record.inference_seconds * 1000)),
        "x-time-per-token": str(int(record.time_per_token_seconds * 1000)),
        "x-prompt-tokens": str(record.input_tokens),
        "x-generated-tokens": str(record.generated_tokens),
    })


def stream_headers(resp: falcon.asgi.Response, request: GenerationRequest, device: str) -> None:
    """What a streamed response can say before its tokens exist (as TGI's streams do)."""
    resp.content_type = "text/event-stream"
    resp.set_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "x-compute-type": device,
                      "x-compute-characters": str(len(request.inputs))})


def record_of(req: falcon.asgi.Request) -> RequestRecord:
    """The request's record (made by the middleware for the generation routes; made here for a
    plugin's route that generates)."""
    record = getattr(req.context, "record", None)
    if record is None:
        record = req.context.record = req.scope["tokenmill.record"] = RequestRecord(
            req.context.request_id, req.path.strip("/") or "generate", time.time_ns())
        state: ServerState = req.scope["tokenmill.state"]
        state.telemetry.request_arrived(record)
    return record


@dataclass
class StreamRun:
    """The sequences of one streamed response and what they hold until it ends."""

    engine: Engine
    seqs: list[Sequence]
    channel: Channel
    record: RequestRecord
    slot: Slot
    completed: bool = False
    """Every choice reached its end (the stream may close normally)."""


# ---- routes ----------------------------------------------------------------------------


class Generation:
    """Runs validated requests through the engine: TGI's generate routes and OpenAI's (whose parsing
    and response shapes live in ``tokenmill.http.openai``), each holding one concurrency slot."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def prepare(self, req: falcon.asgi.Request, stream: bool | None) -> tuple[GenerationRequest, bool]:
        self.state.ready_engine()
        body = await read_json(req, self.state.config.payload_limit)
        if stream is None:
            stream = bool(isinstance(body, dict) and body.get("stream"))
        try:
            inputs, params = parse_body(body)
            params = with_header_priority(req, params)
            request = await self.validate(self.validator().generate, inputs, params, stream)
        except ValidationError as error:
            raise ApiError(422, str(error), "validation") from None
        return request, stream

    def validator(self) -> Validator:
        assert self.state.validator is not None, "validation runs only once the model is ready"
        return self.state.validator

    @property
    def device(self) -> str:
        assert self.state.loaded is not None
        return self.state.loaded.device.type

    async def validate(self, check: Callable[..., Any], *args: Any) -> Any:
        """Run ``check(*args)`` on the tokenizer thread (tokenizing and compiling grammars take milliseconds),
        in this request's context (its log lines carry its id)."""
        return await asyncio.get_running_loop().run_in_executor(
            self.state.tokenizer_thread, contextvars.copy_context().run, check, *args)

    async def run_to_end(self, req: falcon.asgi.Request, jobs: list[tuple[GenerationRequest, int | None]]
                         ) -> list[FinalResult]:
        """Run each (request, seed) job as one sequence to its end, results in order; cancel them
        all if the client leaves or one fails."""
        engine = self.state.ready_engine()
        channels = [Channel() for _ in jobs]
        seqs = [engine.submit(request, channel.sink, seed) for (request, seed), channel in zip(jobs, channels)]
        for seq, channel in zip(seqs, channels):
            on_disconnect(req, cancel_on_disconnect(engine, seq, channel))
        watcher = asyncio.create_task(watch_receive(req))
        try:
            return list(await asyncio.gather(*(self.wait_final(seq, ch) for seq, ch in zip(seqs, channels))))
        except BaseException:
            for seq in seqs:
                engine.cancel(seq)
            raise
        finally:
            watcher.cancel()

    async def wait_final(self, seq: Sequence, channel: Channel) -> FinalResult:
        while True:
            event = await channel.queue.get()
            if event is DISCONNECTED:
                raise ApiError(499, "client disconnected", "cancelled")
            if isinstance(event, ErrorEvent):
                raise ApiError(424 if event.error_type == "generation" else 503, event.message, event.error_type)
            if event.final is not None:
                return event.final

    async def pin_adapter(self, slot: Slot, jobs: list[tuple[GenerationRequest, int | None]]
                          ) -> list[tuple[GenerationRequest, int | None]]:
        """The jobs with their LoRA adapter's weights, pinned in memory until ``slot`` is given back
        (loaded on the tokenizer thread if it was evicted)."""
        name = jobs[0][0].adapter_id
        if name is None:
            return jobs
        adapters = self.state.adapters
        assert adapters is not None, "validation lets adapter ids through only when adapters are served"
        # Pinned here on the event loop, so that a request cancelled while its adapter loads holds no pin.
        adapter = adapters.pin(name)
        for _ in range(3):  # another request's load may evict it between our load and our pin
            if adapter is not None:
                break
            try:
                await self.validate(adapters.load, name)
            except AdapterBusy as error:
                raise ApiError(429, str(error), "overloaded") from None
            except AdapterError as error:
                raise ApiError(422, str(error), "validation") from None
            adapter = adapters.pin(name)
        if adapter is None:
            raise ApiError(429, f"adapter {name!r} was evicted again while loading; retry", "overloaded")
        slot.adapter = adapter
        return [(replace(request, adapter=adapter), seed) for request, seed in jobs]

    def started(self, record: RequestRecord, requests: list[GenerationRequest]) -> None:
        """The request (one or, for a list of prompts, several) passed validation and goes to the engine."""
        request = requests[0]
        record.validation_seconds = time.monotonic() - record.started_monotonic
        record.input_tokens = sum(len(r.input_ids) for r in requests)
        record.max_new_tokens = request.max_new_tokens
        record.parameters = request.parameters
        record.inputs = request.inputs if self.state.config.log_prompts else None
        self.state.pm.hook.tokenmill_request_started(
            request_id=record.request_id, inputs=request.inputs, parameters=request.parameters)

    def finished(self, record: RequestRecord, result: FinalResult | None, error: str | None = None,
                 error_type: str | None = None, generated_tokens: int = 0, cached_tokens: int = 0) -> None:
        """The request ended: ``result`` (its best or first sequence's, as TGI reports ``best_of``) on
        success, else the error and the ``generated_tokens`` it had produced; ``cached_tokens`` of its
        prompts came from the prefix cache."""
        record.cached_tokens = cached_tokens
        if result is not None:
            record.queue_seconds, record.inference_seconds = result.queue_seconds, result.inference_seconds
            record.finish_reason = result.finish_reason
        record.generated_tokens = result.generated_tokens if result is not None else generated_tokens
        if error is not None:
            record.error, record.error_type = error, error_type or "generation"
        self.state.telemetry.request_finished(record)
        self.state.pm.hook.tokenmill_request_finished(
            request_id=record.request_id,
            finish_reason=result.finish_reason if result else None,
            generated_tokens=record.generated_tokens,
            error=error,
        )

    async def run_tracked(self, req: falcon.asgi.Request, jobs: list[tuple[GenerationRequest, int | None]]
                          ) -> list[FinalResult]:
        """``run_to_end`` holding one concurrency slot, reported when it ends."""
        slot = self.state.take_slot()
        record = record_of(req)
        try:
            self.started(record, list({id(request): request for request, _ in jobs}.values()))  # each prompt once
            jobs = await self.pin_adapter(slot, jobs)
            results = await self.run_to_end(req, jobs)
        except ApiError as error:
            self.finished(record, None, error.message, error.error_type)
            raise
        except BaseException as error:
            kind = "cancelled" if isinstance(error, asyncio.CancelledError) else "internal"
            self.finished(record, None, f"{type(error).__name__}: {error}", kind)
            raise
        finally:
            slot.release()
        self.finished(record, max(results, key=lambda r: r.logprob_sum()),
                      cached_tokens=per_prompt([request for request, _ in jobs], [r.cached_tokens for r in results]))
        return results

    async def respond_json(self, req: falcon.asgi.Request, resp: falcon.asgi.Response,
                           request: GenerationRequest, as_list: bool) -> None:
        results = await self.run_tracked(req, [(request, None)] * request.best_of)
        best = max(results, key=lambda r: r.logprob_sum())
        body: dict[str, Any] = {"generated_text": best.generated_text}
        if request.details:
            body["details"] = details_json(best, request.top_n_tokens > 0)
            if request.best_of > 1:
                body["details"]["best_of_sequences"] = [
                    {"generated_text": r.generated_text, **details_json(r, request.top_n_tokens > 0)}
                    for r in results if r is not best
                ]
        timing_headers(resp, record_of(req), request, self.device)
        resp.media = [body] if as_list else body

    async def respond_stream(self, req: falcon.asgi.Request, resp: falcon.asgi.Response,
                             request: GenerationRequest) -> None:
        run = await self.open_stream(req, resp, [(request, None)], [request])
        resp.sse = self.tgi_events(run, request)

    async def tgi_events(self, run: StreamRun, request: GenerationRequest) -> AsyncIterator[falcon.asgi.SSEvent]:
        async with contextlib.aclosing(self.stream_events(run)) as events:
            async for _, event in events:
                body = event.as_json() if isinstance(event, ErrorEvent) else self.stream_json(event, request)
                yield falcon.asgi.SSEvent(json=body)

    @staticmethod
    def stream_json(event: TokenEvent, request: GenerationRequest) -> dict[str, Any]:
        final = event.final
        details = None
        if final is not None and request.details:
            details = {
                "finish_reason": final.finish_reason,
                "generated_tokens": final.generated_tokens,
                "seed": final.seed,
                "input_length": final.input_length,
            }
        return {
            "index": event.index,
            "token": event.token.as_json(),
            "top_tokens": [t.as_json() for t in event.top_tokens],
            "generated_text": final.generated_text if final is not None else None,
            "details": details,
        }


    async def run_openai(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, job: OpenAIJob
                         ) -> list[FinalResult]:
        results = await self.run_tracked(req, job.sequences())
        timing_headers(resp, record_of(req), job.requests[0], self.device)
        return results

    async def stream_openai(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, job: OpenAIJob,
                            stream: OpenAIStream) -> None:
        """Stream every choice of ``job`` in one SSE response, chunks tagged with their choice index."""
        run = await self.open_stream(req, resp, job.sequences(), job.requests)
        resp.sse = sse_events(self.openai_chunks(run, stream))

    async def openai_chunks(self, run: StreamRun, stream: OpenAIStream) -> AsyncIterator[dict[str, Any] | None]:
        """The stream's chunks; None last, for ``data: [DONE]``. An error ends it with an error event."""
        for chunk in stream.opening():
            yield chunk
        async with contextlib.aclosing(self.stream_events(run)) as events:
            async for index, event in events:
                if isinstance(event, ErrorEvent):
                    yield event.as_json()
                    return
                for chunk in stream.on_event(index, event):
                    yield chunk
        if run.completed:
            for chunk in stream.closing():
                yield chunk
            yield None

    async def open_stream(self, req: falcon.asgi.Request, resp: falcon.asgi.Response,
                          jobs: list[tuple[GenerationRequest, int | None]], requests: list[GenerationRequest]
                          ) -> StreamRun:
        """Start the sequences of a streamed response: its slot, its adapter, the start hook, one
        channel of (choice, event) pairs, and cancellation the moment the client leaves."""
        engine = self.state.ready_engine()
        slot = self.state.take_slot()
        record = record_of(req)
        channel = Channel()
        seqs: list[Sequence] = []
        try:
            jobs = await self.pin_adapter(slot, jobs)
            self.started(record, requests)
            for i, (request, seed) in enumerate(jobs):
                seqs.append(engine.submit(request, lambda event, i=i: channel.sink((i, event)), seed,
                                          backlog=channel.backlog))
        except BaseException:
            for seq in seqs:
                engine.cancel(seq)
            slot.release()
            raise
        for seq in seqs:
            on_disconnect(req, cancel_on_disconnect(engine, seq, channel))
        on_disconnect(req, slot.release)  # also when the response never starts streaming
        stream_headers(resp, requests[0], self.device)
        return StreamRun(engine, seqs, channel, record, slot)

    async def stream_events(self, run: StreamRun) -> AsyncIterator[tuple[int, TokenEvent | ErrorEvent]]:
        """The (choice, event) pairs of a streamed response until every choice has ended, or up to an
        error event. However it ends (the client may leave), its sequences stop, its slot is given
        back and the request is reported, once."""
        first: FinalResult | None = None
        error: ErrorEvent | None = None
        running = len(run.seqs)
        try:
            while running:
                item = await run.channel.queue.get()
                if item is DISCONNECTED:
                    error = ErrorEvent("client disconnected", "cancelled")
                    return
                index, event = item
                if isinstance(event, ErrorEvent):
                    error = event  # before yielding: the reader may stop at it
                    yield index, event
                    return
                yield index, event
                run.channel.delivered += 1  # asked for the next one: this one has been sent
                if event.final is not None:
                    running -= 1
                    first = first or event.final
            run.completed = True
        finally:
            if running:
                for seq in run.seqs:
                    run.engine.cancel(seq)
                error = error or ErrorEvent("client disconnected", "cancelled")
            run.slot.release()
            self.finished(run.record, None if error else first, error.message if error else None,
                          error.error_type if error else None,
                          generated_tokens=sum(len(seq.generated_ids) for seq in run.seqs),
                          cached_tokens=per_prompt([seq.request for seq in run.seqs],
                                                   [seq.cached_tokens for seq in run.seqs]))


class GenerateRoute:
    def __init__(self, generation: Generation, stream: bool | None) -> None:
        self.generation = generation
        self.stream = stream

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        request, stream = await self.generation.prepare(req, self.stream)
        if stream:
            await self.generation.respond_stream(req, resp, request)
        else:
            await self.generation.respond_json(req, resp, request, as_list=self.stream is None)


class TokenizeRoute:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        self.state.ready_engine()
        body = await read_json(req, self.state.config.payload_limit)
        try:
            inputs, _ = parse_body(body)
        except ValidationError as error:
            raise ApiError(422, str(error), "validation") from None
        assert self.state.loaded is not None
        tokenizer = self.state.loaded.tokenizer
        if not getattr(tokenizer, "is_fast", False):
            raise ApiError(404, "No fast tokenizer available", "tokenizer")
        encoding = await asyncio.get_running_loop().run_in_executor(
            self.state.tokenizer_thread,
            lambda: tokenizer(inputs, add_special_tokens=True, return_offsets_mapping=True))
        resp.media = [
            {"id": token_id, "text": inputs[start:stop], "start": start, "stop": stop}
            for token_id, (start, stop) in zip(encoding["input_ids"], encoding["offset_mapping"])
        ]


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
        cache = self.cache()
        body = await read_json(req, self.state.config.payload_limit)
        if not isinstance(body, dict) or not isinstance(body.get("id"), str) or not isinstance(
                body.get("path", body.get("id")), str):
            raise ApiError(422, 'the body must be {"id": "<name>", "path": "<PEFT adapter directory>"}', "validation")
        name, source = body["id"], body.get("path", body["id"])
        try:
            adapter = await asyncio.get_running_loop().run_in_executor(
                self.state.tokenizer_thread, cache.register, name, source)
        except AdapterBusy as error:
            raise ApiError(429, str(error), "overloaded") from None
        except AdapterError as error:
            raise ApiError(422, str(error), "validation") from None
        resp.media = {"id": adapter.name, "rank": adapter.rank, "layers": len(adapter.layers),
                      "path": str(adapter.path)}


class ResetPrefixCacheRoute:
    """``POST /reset_prefix_cache`` (vLLM's route): drop every cached KV block that no sequence holds,
    between two engine steps. Behind ``--api-key``."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        engine = self.state.ready_engine()
        loop = asyncio.get_running_loop()
        dropped: asyncio.Future[int] = loop.create_future()
        engine.reset_prefix_cache(lambda count: loop.call_soon_threadsafe(dropped.set_result, count))
        resp.media = {"prefix_caching": self.state.prefix_caching_off is None, "dropped_blocks": await dropped}


class HealthRoute:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        if self.state.draining:
            raise ApiError(503, "the server is shutting down", "unhealthy")
        self.state.ready_engine()
        resp.status = falcon.HTTP_200
        resp.text = ""


class InfoRoute:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        state, config = self.state, self.state.config
        loaded = state.loaded
        resp.media = {
            "model_id": loaded.model_id if loaded else config.model_id,
            "model_sha": None,
            "model_dtype": str(loaded.dtype).replace("torch.", "") if loaded else config.dtype,
            "quantize": loaded.quantization if loaded else config.quantize,
            "num_shard": config.num_shard,
            "model_device_type": loaded.device.type if loaded else None,
            "model_pipeline_tag": "text-generation",
            "max_concurrent_requests": config.max_concurrent_requests,
            "max_best_of": config.max_best_of,
            "max_stop_sequences": config.max_stop_sequences,
            "max_input_tokens": config.max_input_tokens,
            "max_total_tokens": config.max_total_tokens,
            "max_batch_prefill_tokens": config.max_batch_prefill_tokens,
            "max_batch_total_tokens": config.max_batch_total_tokens,
            "max_batch_size": config.max_batch_size,
            "max_top_n_tokens": config.max_top_n_tokens,
            "validation_workers": 1,
            "max_client_batch_size": 1,
            "router": "tokenmill",
            "version": __version__,
            "sha": None,
            "docker_label": os.environ.get("DOCKER_LABEL"),
            "backend": state.chosen.backend.name if state.chosen else config.backend,
            "attention": plugin_name(state.chosen.attention) if state.chosen else config.attention,
            "scheduler": config.scheduler,
            "kv_allocator": plugin_name(state.chosen.kv_allocator) if state.chosen else config.kv_allocator,
            "block_size": state.chosen.block_size if state.chosen and state.chosen.backend.kv_layout == "paged" else None,
            "prefix_caching": state.engine is not None and state.prefix_caching_off is None,
            "prefix_caching_off_reason": state.prefix_caching_off,
            "kv": state.engine.runner.kv_usage() if state.engine else None,
            "lora_adapters": state.adapters.names if state.adapters is not None else None,
            "ready": state.engine is not None and state.engine.healthy,
            "load_stage": "ready" if state.engine is not None else (state.stages.current or "starting"),
            "load_stages": state.stages.done,
            "queue_size": state.engine.queue_size if state.engine else 0,
            "batch_size": state.engine.batch_size if state.engine else 0,
        }


def plugin_name(chosen: Any) -> str | None:
    """A chosen plugin's name; None where the backend's own engine does that part."""
    return chosen.name if chosen is not None else None


class ErrorHandlers:
    """Every error is answered with TGI's body; a generation request that fails before it reached
    the engine (422, 429, 503, ...) is reported like one that failed in it."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def report(self, req: falcon.asgi.Request, message: str, error_type: str) -> None:
        record = getattr(req.context, "record", None)
        if record is not None:
            self.state.telemetry.request_failed(record, message, error_type)

    async def api_error(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, error: ApiError,
                        params: Any) -> None:
        resp.status = falcon.code_to_http_status(error.status) if error.status != 499 else "499 Client Closed Request"
        resp.media = error.body()
        self.report(req, error.message, error.error_type)

    async def unexpected(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, error: Exception,
                         params: Any) -> None:
        if isinstance(error, falcon.HTTPError):
            resp.status = error.status
            resp.media = {"error": error.title or str(error.status), "error_type": "http"}
            self.report(req, resp.media["error"], "http")
            return
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
        if config.otlp_endpoint:
            from tokenmill.observability.tracing import Tracing

            self.state.telemetry.tracing = Tracing.start(config.otlp_endpoint, config.otlp_service_name)
        if config.prometheus_port:
            self.metrics_server = serve_metrics(self.state.metrics, config.hostname, config.prometheus_port)
        threading.Thread(target=self.state.load_or_exit, name="tokenmill-loader", daemon=True).start()

    async def process_shutdown(self, scope: Any, event: Any) -> None:
        if self.state.engine is not None:
            await asyncio.to_thread(self.state.engine.stop)
        await asyncio.to_thread(self.state.stop_shards)
        self.state.tokenizer_thread.shutdown(wait=False)
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
        if self.state.telemetry.tracing is not None:
            await asyncio.to_thread(self.state.telemetry.tracing.shutdown)


def middleware(state: ServerState) -> list[Any]:
    """In order: CORS (answers preflights, and marks errors too), the API key, the request's id and record."""
    config = state.config
    chain: list[Any] = [Lifespan(state)]
    if config.cors_allow_origin:
        chain.append(cors_middleware(config.cors_allow_origin))
    if config.api_key:  # before the request is counted: anyone without the key must not move the metrics
        chain.append(ApiKeyAuth(config.api_key))
    chain.append(RequestContext(state.telemetry, lambda: state.draining))
    return chain


def create_app(config: Config, pm: pluggy.PluginManager | None = None) -> DisconnectWatch:
    """The ASGI application for ``config``; the model loads when the server starts."""
    pm = pm or build_plugin_manager()
    state = ServerState(config, pm)
    app = falcon.asgi.App(middleware=middleware(state))
    generation = Generation(state)
    app.add_route("/generate", GenerateRoute(generation, stream=False))
    app.add_route("/generate_stream", GenerateRoute(generation, stream=True))
    app.add_route("/", GenerateRoute(generation, stream=None))
    app.add_route("/tokenize", TokenizeRoute(state))
    app.add_route("/health", HealthRoute(state))
    app.add_route("/info", InfoRoute(state))
    app.add_route("/metrics", MetricsRoute(state))
    app.add_route("/queue", QueueRoute(state))
    app.add_route("/v1/chat/completions", ChatCompletionsRoute(generation))
    app.add_route("/v1/completions", CompletionsRoute(generation))
    app.add_route("/v1/models", ModelsRoute(state))
    app.add_route("/adapters", AdaptersRoute(state))
    app.add_route("/reset_prefix_cache", ResetPrefixCacheRoute(state))
    if config.enable_profiling:
        app.add_route("/debug/profile", ProfileRoute())
    errors = ErrorHandlers(state)
    app.add_error_handler(Exception, errors.unexpected)
    app.add_error_handler(ApiError, errors.api_error)
    pm.hook.tokenmill_add_routes(app=app, server=state)
    return DisconnectWatch(app, state)
