"""``POST /v1/responses`` and ``GET /v1/responses/{response_id}``: a Responses request converted into
a chat request (:mod:`~tokenmill.http.responses.convert`) after the stored conversation it continues,
run on the chat path, answered in the Responses shapes, and kept (``store``, the default) for the
next turn."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import falcon.asgi

from tokenmill.engine.sequence import ErrorEvent
from tokenmill.http.body import ApiError
from tokenmill.http.context import caller_of, record_of
from tokenmill.http.generation import Generation, StreamRun, timing_headers
from tokenmill.http.openai.convert import parse_chat
from tokenmill.http.openai.routes import served_model
from tokenmill.http.openai.schemas import ChatRequest
from tokenmill.http.responses.convert import chat_body
from tokenmill.http.responses.schemas import ResponsesRequest
from tokenmill.http.responses.shapes import ResponsesJob, ResponseStream, answer_messages, response_json
from tokenmill.http.responses.store import ResponseStore, StoredResponse
from tokenmill.http.schemas import check_body
from tokenmill.http.state import ServerState
from tokenmill.http.tgi.validation import Validator


def not_found(response_id: str) -> ApiError:
    return ApiError(404, f"no stored response with id {response_id!r} (kept: the latest with `store: true`)",
                    "not_found")


class ResponsesRoute:
    def __init__(self, generation: Generation, store: ResponseStore) -> None:
        self.generation = generation
        self.state: ServerState = generation.state
        self.store = store

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        generation, state, store = self.generation, self.state, self.store
        model, caller, chat_format = served_model(state), caller_of(req), state.chat_format

        def checked(body: object, validator: Validator) -> ResponsesJob:  # on a validation worker
            assert chat_format is not None  # chosen before the engine is ready
            request = check_body(ResponsesRequest, body)
            history: list[dict[str, Any]] = []
            if request.previous_response_id is not None:
                previous = store.get(request.previous_response_id)
                if previous is None:
                    raise not_found(request.previous_response_id)
                history = previous.conversation
            chat, conversation = chat_body(request, history)
            job = parse_chat(validator, check_body(ChatRequest, chat), model, caller, chat_format)
            return ResponsesJob(job, request, conversation)

        slot, rjob = await generation.admitted(req, checked)
        job = rjob.job
        if job.stream:
            run = await generation.open_stream(req, resp, slot, job.sequences(), job.requests)
            resp.sse = self.events(run, ResponseStream(rjob))
            return
        (result,) = await generation.run_tracked(req, slot, job.sequences())
        timing_headers(resp, record_of(req), job.requests[0], generation.device)
        resp.media = self.kept(rjob, response_json(rjob, result))

    def kept(self, rjob: ResponsesJob, body: dict[str, Any]) -> dict[str, Any]:
        """``body``, stored with its conversation when the request asks (``store``, the default)."""
        if rjob.request.store:
            self.store.put(rjob.id, StoredResponse(body, rjob.conversation + answer_messages(body["output"])))
        return body

    async def events(self, run: StreamRun, stream: ResponseStream) -> AsyncIterator[falcon.asgi.SSEvent]:
        """The stream's events, each with its ``event:`` name; an error ends it with an ``error`` event."""
        for name, data in stream.opening():
            yield falcon.asgi.SSEvent(event=name, json=data)
        async with contextlib.aclosing(self.generation.stream_events(run)) as events:
            async for _, event in events:
                if isinstance(event, ErrorEvent):
                    yield falcon.asgi.SSEvent(event="error", json={
                        "type": "error", "code": event.error_type, "message": event.message, "param": None,
                        "sequence_number": stream.sequence})
                    return
                for name, data in stream.on_event(event):
                    yield falcon.asgi.SSEvent(event=name, json=data)
        if stream.final is not None:
            self.kept(stream.rjob, stream.final)


class StoredResponseRoute:
    """``GET /v1/responses/{response_id}``: a stored response."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, response_id: str) -> None:
        stored = self.store.get(response_id)
        if stored is None:
            raise not_found(response_id)
        resp.media = stored.body
