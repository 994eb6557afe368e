"""OpenAI's routes: ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models``."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import falcon.asgi

from tokenmill.engine.sequence import ErrorEvent
from tokenmill.http.context import caller_of, record_of
from tokenmill.http.generation import Generation, StreamRun, timing_headers
from tokenmill.http.openai.convert import OpenAIJob, parse_chat, parse_completion
from tokenmill.http.openai.schemas import ChatRequest, CompletionRequest
from tokenmill.http.openai.shapes import OpenAIStream, chat_completion_json, completion_json, sse_events
from tokenmill.http.schemas import check_body
from tokenmill.http.state import ServerState
from tokenmill.http.tgi.validation import Validator


class OpenAIRoute:
    """Shared by the two generation routes: parse on the tokenizer thread, then answer whole or stream."""

    chat: bool

    def __init__(self, generation: Generation) -> None:
        self.generation = generation
        self.state: ServerState = generation.state

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        generation, state = self.generation, self.state
        model, caller, chat_format = served_model(state), caller_of(req), state.chat_format

        def checked(body: object, validator: Validator) -> OpenAIJob:  # on a validation worker
            if self.chat:
                assert chat_format is not None  # chosen before the engine is ready
                return parse_chat(validator, check_body(ChatRequest, body), model, caller, chat_format)
            return parse_completion(validator, check_body(CompletionRequest, body), model, caller)

        slot, job = await generation.admitted(req, checked)
        if job.stream:
            run = await generation.open_stream(req, resp, slot, job.sequences(), job.requests)
            resp.sse = sse_events(self.chunks(run, OpenAIStream(job, self.chat)))
            return
        results = await generation.run_tracked(req, slot, job.sequences())
        timing_headers(resp, record_of(req), job.requests[0], generation.device)
        resp.media = chat_completion_json(job, results) if self.chat else completion_json(job, results)

    async def chunks(self, run: StreamRun, stream: OpenAIStream) -> AsyncIterator[dict[str, Any] | None]:
        """The stream's chunks, every choice's in one response tagged with its index; None last, for
        ``data: [DONE]``. An error ends it with an error event."""
        for chunk in stream.opening():
            yield chunk
        async with contextlib.aclosing(self.generation.stream_events(run)) as events:
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


class ChatCompletionsRoute(OpenAIRoute):
    chat = True


class CompletionsRoute(OpenAIRoute):
    chat = False


def served_model(state: ServerState) -> str:
    """The model's name in responses and /v1/models: ``--served-model-name``, else its id."""
    if state.config.served_model_name:
        return state.config.served_model_name
    loaded = state.loaded
    return loaded.model_id if loaded is not None else (state.config.model_id or "tokenmill")


class ModelsRoute:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        """The base model, then each LoRA adapter (whose id, as ``model``, selects it)."""
        created = int(time.time())
        base = served_model(self.state)
        adapters = self.state.adapters.names if self.state.adapters is not None else []
        resp.media = {"object": "list", "data": [
            {"id": base, "object": "model", "created": created, "owned_by": "tokenmill"},
            *({"id": name, "object": "model", "created": created, "owned_by": "tokenmill", "parent": base}
              for name in adapters)]}
