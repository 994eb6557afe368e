"""One generation request's life, whichever API it came by: a concurrency slot, its adapter
pinned, its sequences submitted to the engine, their events read from the request's token
stream until each ends (or the client leaves), and the request reported once."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import falcon.asgi

from tokenmill.engine import Engine
from tokenmill.engine.sequence import ErrorEvent, FinalResult, GenerationRequest, Sequence, TokenEvent
from tokenmill.engine.stream import StreamClosed, TokenStream
from tokenmill.http.body import ApiError, read_json
from tokenmill.http.context import HANDED_SLOT, on_disconnect, record_of, watch_receive
from tokenmill.http.schemas import ValidationError
from tokenmill.http.state import ServerState, Slot, adapter_api_error
from tokenmill.http.tgi.validation import Validator
from tokenmill.model.lora import AdapterBusy, AdapterError
from tokenmill.observability.telemetry import RequestRecord

log = logging.getLogger(__name__)

T = TypeVar("T")

Job = tuple[GenerationRequest, "int | None"]
"""One sequence to run: its request and its seed (None: the request's own, or a new one)."""


def per_prompt(requests: list[GenerationRequest], counts: list[int]) -> int:
    """The sum of ``counts`` over the distinct requests (the choices of one prompt count once)."""
    seen: dict[int, int] = {}
    for request, count in zip(requests, counts):
        seen.setdefault(id(request), count)
    return sum(seen.values())


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


def cancel_on_disconnect(engine: Engine, seq: Sequence, stream: TokenStream) -> Callable[[], None]:
    """A disconnect callback that cancels ``seq`` and wakes whoever reads ``stream``."""
    def cancel() -> None:
        engine.cancel(seq)
        stream.close()

    return cancel


_failed_observers: set[str] = set()


def observe(what: str, call: Callable[[], object]) -> None:
    """Tell an observer (a plugin's hook, the metrics, the trace) about a request: one that raises never
    changes the response, and is logged once, with its traceback, the first time it does."""
    try:
        call()
    except Exception:  # noqa: BLE001 - an observer's failure is its own
        if what not in _failed_observers:
            _failed_observers.add(what)
            log.exception("%s raised; the response goes on (logged once)", what)


@dataclass
class StreamRun:
    """The sequences of one streamed response and what they hold until it ends."""

    engine: Engine
    seqs: list[Sequence]
    stream: TokenStream
    record: RequestRecord
    slot: Slot
    completed: bool = False
    """Every choice reached its end (the stream may close normally)."""


class Generation:
    """Runs validated requests through the engine, for TGI's generate routes and OpenAI's, each
    holding one concurrency slot."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def validate(self, check: Callable[[Validator], T]) -> T:
        """``check(validator)`` on a validation worker; a ValidationError becomes a 422."""
        try:
            return await self.state.workers.validate(check)
        except ValidationError as error:
            raise ApiError(422, str(error), "validation") from None

    async def admitted(self, req: falcon.asgi.Request, check: Callable[[Any, Validator], T]) -> tuple[Slot, T]:
        """The request's concurrency slot (the one a route handed over, or a new one) and
        ``check(body, validator)`` of its JSON body, run on a validation worker; the slot is let go
        when anything fails before the request is handed on."""
        state = self.state
        state.ready_engine()
        slot = state.take_slot(req.context.pop(HANDED_SLOT, None))
        try:
            body = await read_json(req, state.config)
            return slot, await self.validate(lambda validator: check(body, validator))
        except BaseException:
            slot.release()
            raise

    @property
    def device(self) -> str:
        assert self.state.loaded is not None
        return self.state.loaded.device.type

    async def run_to_end(self, req: falcon.asgi.Request, jobs: list[Job]
                         ) -> list[FinalResult]:
        """Run each (request, seed) job as one sequence to its end, results in order; cancel them
        all if the client leaves or one fails."""
        engine = self.state.ready_engine()
        streams = [TokenStream(paced=False) for _ in jobs]  # a whole response never holds its sequences back
        seqs = [engine.submit(request, stream, seed) for (request, seed), stream in zip(jobs, streams)]
        for seq, stream in zip(seqs, streams):
            on_disconnect(req, cancel_on_disconnect(engine, seq, stream))
        watcher = asyncio.create_task(watch_receive(req))
        record = record_of(req)
        waiters = [asyncio.ensure_future(self.wait_final(stream, record, i)) for i, stream in enumerate(streams)]
        try:
            return list(await asyncio.gather(*waiters))
        except BaseException:
            for seq, waiter in zip(seqs, waiters):  # one choice failed: its siblings end too
                engine.cancel(seq)
                waiter.cancel()
            raise
        finally:
            watcher.cancel()

    async def wait_final(self, stream: TokenStream, record: RequestRecord, sequence: int) -> FinalResult:
        """The final result of the one sequence written into ``stream``, the request's ``sequence``-th;
        its tokens are timed as they come."""
        while True:
            try:
                _, event = await stream.next()
            except StreamClosed:
                raise ApiError(499, "client disconnected", "cancelled") from None
            if isinstance(event, ErrorEvent):
                raise ApiError(424 if event.error_type == "generation" else 503, event.message, event.error_type)
            self.state.telemetry.token_arrived(record, sequence, event.emitted_at)
            if event.final is not None:
                return event.final

    async def pin_adapter(self, slot: Slot, jobs: list[Job]
                          ) -> list[Job]:
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
                await self.state.workers.run(adapters.load, name)
            except (AdapterBusy, AdapterError) as error:
                raise adapter_api_error(error) from None
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
        observe("tokenmill_request_started", lambda: self.state.pm.hook.tokenmill_request_started(
            request_id=record.request_id, inputs=request.inputs, parameters=request.parameters))

    def finished(self, record: RequestRecord, result: FinalResult | None, error: str | None = None,
                 error_type: str | None = None, generated_tokens: int = 0, cached_tokens: int = 0) -> None:
        """The request ended: ``result`` (its best or first sequence's, as TGI reports ``best_of``) on
        success, else the error and the ``generated_tokens`` it had produced; ``cached_tokens`` of its
        prompts came from the prefix cache."""
        record.cached_tokens = cached_tokens
        if result is not None:
            record.queue_seconds, record.inference_seconds = result.queue_seconds, result.inference_seconds
            record.finish_reason = result.finish_reason
            record.draft_tokens, record.accepted_tokens = result.draft_tokens, result.accepted_tokens
        record.generated_tokens = result.generated_tokens if result is not None else generated_tokens
        if error is not None:
            record.error, record.error_type = error, error_type or "generation"
        observe("the request's metrics and trace", lambda: self.state.telemetry.request_finished(record))
        observe("tokenmill_request_finished", lambda: self.state.pm.hook.tokenmill_request_finished(
            request_id=record.request_id, finish_reason=result.finish_reason if result else None,
            generated_tokens=record.generated_tokens, error=error))

    async def run_tracked(self, req: falcon.asgi.Request, slot: Slot, jobs: list[Job]
                          ) -> list[FinalResult]:
        """``run_to_end`` holding the request's concurrency ``slot`` (given back when it ends), reported."""
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

    async def open_stream(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, slot: Slot,
                          jobs: list[Job], requests: list[GenerationRequest]
                          ) -> StreamRun:
        """Start the sequences of a streamed response holding the request's ``slot``: its adapter, the
        start hook, one token stream of (choice, event) pairs, and cancellation the moment the client leaves."""
        seqs: list[Sequence] = []
        try:
            engine = self.state.ready_engine()
            record = record_of(req)
            stream = TokenStream(on_sent=engine.wake, on_error=slot.release)
            jobs = await self.pin_adapter(slot, jobs)
            self.started(record, requests)
            for i, (request, seed) in enumerate(jobs):
                seqs.append(engine.submit(request, stream, seed, choice=i))
        except BaseException:
            for seq in seqs:
                engine.cancel(seq)
            slot.release()
            raise
        for seq in seqs:
            on_disconnect(req, cancel_on_disconnect(engine, seq, stream))
        on_disconnect(req, slot.release)  # also when the response never starts streaming
        stream_headers(resp, requests[0], self.device)
        return StreamRun(engine, seqs, stream, record, slot)

    async def stream_events(self, run: StreamRun) -> AsyncIterator[tuple[int, TokenEvent | ErrorEvent]]:
        """The (choice, event) pairs of a streamed response until every choice has ended, or up to an
        error event. However it ends (the client may leave), its sequences stop, its slot is given
        back and the request is reported, once."""
        first: FinalResult | None = None
        error: ErrorEvent | None = None
        running = len(run.seqs)
        try:
            while running:
                try:
                    index, event = await run.stream.next()
                except StreamClosed:
                    error = ErrorEvent("client disconnected", "cancelled")
                    return
                if isinstance(event, ErrorEvent):
                    error = event  # before yielding: the reader may stop at it
                    yield index, event
                    return
                self.state.telemetry.token_arrived(run.record, index, event.emitted_at)
                yield index, event
                run.stream.sent()  # asked for the next one: this one has been sent
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
