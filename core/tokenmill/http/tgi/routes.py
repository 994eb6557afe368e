"""TGI's generation routes (``/generate``, ``/generate_stream``, ``/``) and ``/tokenize``'s TGI form."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import falcon.asgi

from tokenmill.engine.sequence import ErrorEvent, FinalResult, GenerationRequest, TokenEvent
from tokenmill.http.body import read_json
from tokenmill.http.context import HANDED_SLOT, Caller, caller_of, record_of
from tokenmill.http.generation import Generation, StreamRun, timing_headers
from tokenmill.http.images import markdown_images
from tokenmill.http.schemas import ValidationError, check_body
from tokenmill.http.state import Slot
from tokenmill.http.tgi.schemas import CompatGenerateRequest, GenerateParameters, GenerateRequest
from tokenmill.http.tgi.validation import Validator


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


def stream_json(event: TokenEvent, request: GenerationRequest) -> dict[str, Any]:
    """One event of a TGI stream."""
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


class GenerateRoute:
    """``POST /generate`` (``stream=False``), ``/generate_stream`` (True) and ``/`` (None: the body's
    ``stream`` decides, and a whole answer is a list)."""

    def __init__(self, generation: Generation, stream: bool | None) -> None:
        self.generation = generation
        self.state = generation.state
        self.stream = stream

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        self.state.ready_engine()
        slot = self.state.take_slot(req.context.pop(HANDED_SLOT, None))
        try:
            request, stream = await self.prepare(req)
        except BaseException:
            slot.release()
            raise
        if stream:
            run = await self.generation.open_stream(req, resp, slot, [(request, None)], [request])
            resp.sse = self.events(run, request)
        else:
            await self.respond_json(req, resp, slot, request, as_list=self.stream is None)

    async def prepare(self, req: falcon.asgi.Request) -> tuple[GenerationRequest, bool]:
        body = await read_json(req, self.state.config)
        shape = GenerateRequest if self.stream is not None else CompatGenerateRequest
        caller = caller_of(req)

        def checked(validator: Validator) -> tuple[GenerationRequest, bool]:  # on a validation worker
            request = check_body(shape, body)
            params = with_priority(request.parameters, caller)
            stream = self.stream if self.stream is not None else bool(request.stream)
            inputs, images = markdown_images(request.inputs, validator.vision)
            return validator.generate(inputs, params, stream, tenant=caller.tenant, image_urls=images), stream

        return await self.generation.validate(checked)

    async def respond_json(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, slot: Slot,
                           request: GenerationRequest, as_list: bool) -> None:
        results = await self.generation.run_tracked(req, slot, [(request, None)] * request.best_of)
        best = max(results, key=lambda r: r.logprob_sum())
        body: dict[str, Any] = {"generated_text": best.generated_text}
        if request.details:
            body["details"] = details_json(best, request.top_n_tokens > 0)
            if request.best_of > 1:
                body["details"]["best_of_sequences"] = [
                    {"generated_text": r.generated_text, **details_json(r, request.top_n_tokens > 0)}
                    for r in results if r is not best
                ]
        timing_headers(resp, record_of(req), request, self.generation.device)
        resp.media = [body] if as_list else body

    async def events(self, run: StreamRun, request: GenerationRequest) -> AsyncIterator[falcon.asgi.SSEvent]:
        async with contextlib.aclosing(self.generation.stream_events(run)) as events:
            async for _, event in events:
                body = event.as_json() if isinstance(event, ErrorEvent) else stream_json(event, request)
                yield falcon.asgi.SSEvent(json=body)


def with_priority(params: GenerateParameters, caller: Caller) -> GenerateParameters:
    """``params`` with the ``X-Priority`` header's class, unless the body gives one (which wins); a body
    ``priority`` from a key that may not set it is refused."""
    if "priority" in params.model_fields_set:
        if not caller.may_set_priority and params.priority != "normal":
            raise ValidationError("`priority`: this API key may not set a priority (--priority-header-keys)")
        return params
    if caller.priority is None:
        return params
    return check_body(GenerateParameters, {**params.model_dump(exclude_unset=True), "priority": caller.priority})


def tgi_tokenize(validator: Validator, body: Any) -> list[dict[str, Any]]:
    """TGI's ``/tokenize``: each token of ``inputs`` (special ones added) with its text and character
    span. TGI reads the body as a generate request: its parameters are checked, then unused."""
    inputs = check_body(GenerateRequest, body).inputs
    encoding = validator.tokenizer(inputs, add_special_tokens=True, return_offsets_mapping=True)
    return [{"id": token_id, "text": inputs[start:stop], "start": start, "stop": stop}
            for token_id, (start, stop) in zip(encoding["input_ids"], encoding["offset_mapping"])]
