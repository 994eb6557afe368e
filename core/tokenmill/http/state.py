"""What the routes share: the server's state (config, plugins, the loaded model, the engine),
its readiness and drain, and the ``--max-concurrent-requests`` slots."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pluggy

from tokenmill.config import Config
from tokenmill.engine import Engine
from tokenmill.engine.pooling import PoolingEngine, start_pooling_engine
from tokenmill.engine.sequence import PRIORITY_CLASSES
from tokenmill.engine.startup import hub_cache, start_engine
from tokenmill.http.body import ApiError
from tokenmill.http.openai.reading import ChatFormat, choose_chat_format
from tokenmill.http.tgi.validation import Validator
from tokenmill.http.workers import ValidationWorkers
from tokenmill.model import kv_memory, sharding
from tokenmill.model.adapters import AdapterCache
from tokenmill.model.chat_template import read_chat_template, use_chat_template
from tokenmill.model.compile import Compiler
from tokenmill.model.loading import LoadedModel, ModelLoadError, Stages
from tokenmill.model.lora import Adapter, AdapterBusy, AdapterError
from tokenmill.model.sharding import ShardProcesses
from tokenmill.model.vision import worker_vision
from tokenmill.observability.metrics import Metrics
from tokenmill.observability.telemetry import Telemetry
from tokenmill.plugin_manager import Chosen

log = logging.getLogger(__name__)

ENGINE_STOP_SECONDS = 10.0
"""After the grace period: how long the engine's current step may take to end."""


BROKEN_EXIT_SECONDS = 2.0
"""Once the engine broke: how long /health answers 503 and the requests get to write their error
before the process exits (status 3, so that its supervisor restarts it; gunicorn stops too)."""

BROKEN_EXIT_STATUS = 3


ANSWER_SECONDS = 5.0
"""... and how long the requests then get to write their error. With uvicorn's own 5 s for
connections this bounds the time after the grace period (``serve.SHUTDOWN_MARGIN_SECONDS``)."""


def adapter_api_error(error: AdapterBusy | AdapterError) -> ApiError:
    """How an adapter that cannot be had now is answered: 429 while the cache is full of pinned
    adapters, else 422."""
    if isinstance(error, AdapterBusy):
        return ApiError(429, str(error), "overloaded")
    return ApiError(422, str(error), "validation")


def wrong_task(task: str, needed: str) -> ApiError:
    """A route for another task than the server's: 404, as vLLM answers a route its model does not serve."""
    return ApiError(404, f"this server runs --task {task}; this route needs a server started with --task {needed}",
                    "not_found")


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
            self.state.last_request = time.monotonic()
            if self.adapter is not None and self.state.adapters is not None:
                self.state.adapters.release(self.adapter)


@contextlib.contextmanager
def slot_held(state: ServerState) -> Iterator[Slot]:
    """A place held while a route that reads a body but generates nothing (/tokenize and the like) runs."""
    slot = state.take_slot()
    try:
        yield slot
    finally:
        slot.release()


class ServerState:
    """Everything the routes share: config, plugins, the loaded model and the engine."""

    def __init__(self, config: Config, pm: pluggy.PluginManager) -> None:
        self.config = config
        self.pm = pm
        self.stages = Stages(observer=lambda stage, seconds, detail: pm.hook.tokenmill_load_stage(
            stage=stage, seconds=seconds, detail=detail))
        self.loaded: LoadedModel | None = None
        self.engine: Engine | None = None
        """The generation engine (``--task generate``)."""
        self.pooler: PoolingEngine | None = None
        """The embedding or score engine (``--task embed`` or ``score``)."""
        self.shards: ShardProcesses | None = None
        """The other ranks, when this process started them (``--num-shard`` without torchrun)."""
        self.shard_failure: str | None = None
        self.load_error: str | None = None
        """Why the model failed to load (the process exits a moment later, unless ``exit_when_load_fails`` is
        off)."""
        self.exit_when_load_fails = True
        """Off for one model of several (``--models-dir``): its requests get the error, the others go on."""
        self.shards_stopping = False
        self.chosen: Chosen | None = None
        self.adapters: AdapterCache | None = None
        """The LoRA adapters (with --lora-adapters or --lora-cache-limit)."""
        self.prefix_caching_off: str | None = None
        """Once loaded: why prompts' computed prefixes are not reused, or None when they are."""
        self.compiler: Compiler | None = None
        """Once loaded: which forward the steps take (eager, compiling in the background, compiled)."""
        self.chat_format: ChatFormat | None = None
        """Once loaded: the parsers that read chat outputs' tool calls and reasoning."""
        self.vocab_size = 0
        self.in_flight = 0
        self.last_request = time.monotonic()
        """When a request last took or gave back its concurrency slot (``--sleep-after-idle`` counts from it)."""
        self.draining = False
        """Set by SIGTERM: /health and new requests say 503 while those in flight finish."""
        self.metrics = Metrics(self.live_snapshot)
        self.telemetry = Telemetry(self.metrics)
        self.workers = ValidationWorkers(config.validation_workers)
        """Where requests are validated, off the event loop (tokenizing a long prompt takes milliseconds)."""

    # ---- loading (runs in its own thread so /health answers meanwhile) ----------------

    def load(self) -> None:
        if self.config.task != "generate":
            self.load_pooler()
            return
        if self.config.num_shard > 1 and "RANK" not in os.environ:  # torchrun starts the other ranks itself
            self.shards = ShardProcesses(self.config)
            threading.Thread(target=self._watch_shards, name="tokenmill-shards", daemon=True).start()
        chat_template = read_chat_template(self.config)  # before the weights: a bad one fails the start at once
        started = start_engine(self.config, self.pm, self.stages, on_chosen=self._set_chosen)
        use_chat_template(started.loaded.tokenizer, chat_template)
        self.chat_format = choose_chat_format(self.pm, self.config.tool_call_parser, self.config.reasoning_parser,
                                              started.loaded.tokenizer)
        self.loaded, self.vocab_size, self.adapters = started.loaded, started.vocab_size, started.adapters
        self.config = started.config  # its limits settled for the model
        self.prefix_caching_off = started.prefix_caching_off
        self.compiler = started.compiler
        self._start(started.engine)
        if self.compiler is not None:  # before /health says 200: a client never sees "eager" while one is due
            self.compiler.start()
        adapters, config, loaded = started.adapters, self.config, started.loaded
        self.workers.start(lambda tokenizer: Validator(
            tokenizer, config, started.vocab_size,
            adapter_names=(lambda: adapters.names) if adapters is not None else None,
            model_id=loaded.model_id, unavailable_reason=started.engine.unavailable_reason,
            vision=worker_vision(loaded.processor, tokenizer, loaded.model.config) if loaded.processor else None),
            loaded.tokenizer)
        self.engine = started.engine

    def load_pooler(self) -> None:
        pooler, self.config = start_pooling_engine(self.config, self.stages, hub_cache(self.config))
        loaded, config = pooler.model.loaded, self.config
        self.loaded = loaded
        self.vocab_size = loaded.model.get_input_embeddings().num_embeddings
        self.chat_format = choose_chat_format(self.pm, None, None, loaded.tokenizer)  # /tokenize reads messages too
        self._start(pooler)
        self.workers.start(lambda tokenizer: Validator(tokenizer, config, self.vocab_size, model_id=loaded.model_id),
                           loaded.tokenizer)
        self.pooler = pooler

    def _start(self, engine: Engine | PoolingEngine) -> None:
        """Start the loaded engine: its limits and steps in the metrics, a broken one ending the process, the
        heap loaded so far frozen out of garbage collection."""
        config = self.config
        assert config.max_input_tokens and config.max_total_tokens
        self.metrics.set_token_limits(config.max_input_tokens, config.max_total_tokens)
        engine.step_observer = self.metrics.step_finished
        engine.broken_observer = self._exit_when_broken
        frozen = kv_memory.freeze_start_heap()
        log.info("%d objects kept out of garbage collection, loaded for the server's life", frozen)
        engine.start()

    @property
    def serving(self) -> PoolingEngine | Engine | None:
        """The engine that answers this server's requests, once loaded."""
        return self.pooler if self.config.task != "generate" else self.engine

    def _exit_when_broken(self, reason: str) -> None:
        """The engine broke (every request was told): /health says 503 for a moment, then the process exits."""
        def exit_soon() -> None:
            time.sleep(BROKEN_EXIT_SECONDS)
            log.error("exiting with status %d: the engine is broken (%s)", BROKEN_EXIT_STATUS, reason)
            if self.shards is not None:
                self.shards.stop(timeout=2.0)
            logging.shutdown()
            os._exit(BROKEN_EXIT_STATUS)

        threading.Thread(target=exit_soon, name="tokenmill-exit", daemon=True).start()

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
            self.load_error = message
            if not self.exit_when_load_fails:
                return
            if self.config.hold_while_loading:
                time.sleep(BROKEN_EXIT_SECONDS)  # the requests held for the load are answered with its error
            logging.shutdown()
            os._exit(3)  # gunicorn treats 3 as "worker failed to boot" and stops instead of retrying

    def check_ready(self) -> None:
        """503 unless the server can answer requests now (what /health says)."""
        if self.load_error is not None:
            raise ApiError(503, f"the model failed to load: {self.load_error}", "unhealthy")
        if self.shard_failure is not None:
            raise ApiError(503, f"the server is stopping: {self.shard_failure}", "unhealthy")
        engine = self.serving
        if engine is None:
            stage = self.stages.current or "starting"
            raise ApiError(503, f"the model is not ready yet ({stage})", "unhealthy")
        if not engine.healthy:
            broken = engine.broken
            raise ApiError(503, f"the engine is broken: {broken}" if broken else "the engine has stopped", "unhealthy")

    def ready_engine(self) -> Engine:
        """The generation engine, or 503 while it cannot serve (404 on a server of another task)."""
        self.check_ready()
        if self.engine is None:
            raise wrong_task(self.config.task, "generate")
        return self.engine

    def ready_pooler(self, task: str | None = None) -> PoolingEngine:
        """The embedding or score engine (of ``task``, when given), or 503 while it cannot serve (404 on a
        server of another task)."""
        self.check_ready()
        if self.pooler is None or (task is not None and self.config.task != task):
            raise wrong_task(self.config.task, task or "embed or score")
        return self.pooler

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
        if self.pooler is not None:
            return {"queue_size": self.pooler.queue_size, "batch_size": self.pooler.batch_size,
                    "batch_max_tokens": 0, "in_flight": self.in_flight, "queue_by_class": {}, "kv": {},
                    "preemptions": 0, "suspensions": 0}
        engine = self.engine
        if engine is None:
            return {}
        view, scheduler = engine.queue_view(), engine.scheduler
        return {
            "queue_size": engine.queue_size,
            "batch_size": engine.batch_size,
            "batch_max_tokens": sum(entry["prompt_tokens"] + entry["max_new_tokens"] for entry in view["running"]),
            "in_flight": self.in_flight,
            "queue_by_class": {name: sum(1 for entry in view["pending"] if entry["priority"] == name)
                               for name in PRIORITY_CLASSES},
            "kv": engine.kv_usage(),
            "sleeping": engine.asleep,
            "lora": self.adapters.usage() if self.adapters is not None else None,
            "preemptions": engine.preemptions,
            "suspensions": engine.suspensions,
            "prefix_cache": {"queried_tokens": scheduler.prefix_queried_tokens,
                             "hit_tokens": scheduler.prefix_hit_tokens} if scheduler.prefix_caching else None,
            "max_batch_total_tokens": self.config.max_batch_total_tokens,
            "adapters_running": {entry["adapter_id"] for entry in view["running"] if entry["adapter_id"]},
            "adapters_waiting": {entry["adapter_id"] for entry in view["pending"] if entry["adapter_id"]},
        }

    def take_slot(self, handed: Slot | None = None) -> Slot:
        """One of the ``--max-concurrent-requests`` places, taken before the request is even read
        (as TGI takes its permit first), or 429. ``handed``: the place a dispatching route (SageMaker's
        /invocations) took for the request already, which it keeps."""
        if handed is not None:
            return handed
        if self.in_flight >= self.config.max_concurrent_requests:
            raise ApiError(429, "Model is overloaded", "overloaded")
        self.in_flight += 1
        self.last_request = time.monotonic()
        return Slot(self)
