"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's requests converted into
chat requests (:mod:`~tokenmill.http.anthropic.convert`), run on the chat path, answered in
Anthropic's shapes (:mod:`~tokenmill.http.anthropic.shapes`)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import falcon.asgi

from tokenmill.engine.sequence import ErrorEvent
from tokenmill.http.anthropic.convert import chat_body
from tokenmill.http.anthropic.schemas import MessagesInput, MessagesRequest
from tokenmill.http.anthropic.shapes import MessageStream, message_json
from tokenmill.http.body import ApiError, read_json
from tokenmill.http.context import caller_of, record_of
from tokenmill.http.generation import Generation, StreamRun, timing_headers
from tokenmill.http.images import image_prompt
from tokenmill.http.openai.chat import message_images
from tokenmill.http.openai.convert import OpenAIJob, parse_chat, render_chat
from tokenmill.http.openai.routes import served_model
from tokenmill.http.openai.schemas import ChatRequest
from tokenmill.http.schemas import ValidationError, check_body
from tokenmill.http.state import ServerState, slot_held
from tokenmill.http.tgi.validation import Validator


class MessagesRoute:
    def __init__(self, generation: Generation) -> None:
        self.generation = generation
        self.state: ServerState = generation.state

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        generation, state = self.generation, self.state
        model, caller, chat_format = served_model(state), caller_of(req), state.chat_format

        def checked(body: object, validator: Validator) -> OpenAIJob:  # on a validation worker
            assert chat_format is not None  # chosen before the engine is ready
            chat = check_body(ChatRequest, chat_body(check_body(MessagesRequest, body)))
            return parse_chat(validator, chat, model, caller, chat_format)

        slot, job = await generation.admitted(req, checked)
        if job.stream:
            run = await generation.open_stream(req, resp, slot, job.sequences(), job.requests)
            resp.sse = self.events(run, MessageStream(job))
            return
        (result,) = await generation.run_tracked(req, slot, job.sequences())
        timing_headers(resp, record_of(req), job.requests[0], generation.device)
        resp.media = message_json(job, result)

    async def events(self, run: StreamRun, stream: MessageStream) -> AsyncIterator[falcon.asgi.SSEvent]:
        """The stream's events, each with its ``event:`` name; an error ends it with Anthropic's
        ``error`` event."""
        for name, data in stream.opening():
            yield falcon.asgi.SSEvent(event=name, json=data)
        async with contextlib.aclosing(self.generation.stream_events(run)) as events:
            async for _, event in events:
                if isinstance(event, ErrorEvent):
                    error: dict[str, Any] = {"type": "api_error", "message": event.message}
                    yield falcon.asgi.SSEvent(event="error", json={"type": "error", "error": error})
                    return
                for name, data in stream.on_event(event):
                    yield falcon.asgi.SSEvent(event=name, json=data)


class CountTokensRoute:
    """``POST /v1/messages/count_tokens``: the prompt's tokens, as ``/v1/messages`` would render it."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        state = self.state
        state.ready_engine()
        chat_format = state.chat_format
        assert chat_format is not None

        def count(validator: Validator) -> int:  # on a validation worker
            chat = check_body(ChatRequest, chat_body(check_body(MessagesInput, body)))
            prompt = render_chat(validator, chat, chat_format).prompt
            if urls := message_images(chat.messages):  # each image as the tokens the processor gives it
                return len(image_prompt(validator.vision, validator.config, prompt, urls, False)[0])
            return len(validator.tokenizer.encode(prompt, add_special_tokens=False))

        with slot_held(state):
            body = await read_json(req, state.config)
            try:
                resp.media = {"input_tokens": await state.workers.validate(count)}
            except ValidationError as error:
                raise ApiError(422, str(error), "validation") from None
