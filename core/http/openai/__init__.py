"""OpenAI's API over the engine: ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models``.

Each body is translated into TGI's parameters and goes through the same validation,
queue and engine as ``/generate``; ``n`` choices are ``n`` sequences of one request.
Unknown fields are ignored as OpenAI's server does; a known field of the wrong type
is a 422 that names it. Errors keep TGI's ``{"error", "error_type"}`` body, which
the ``openai`` client reads as the message.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import falcon
import falcon.asgi

from tokenmill import __version__
from tokenmill.http.openai.chat import ChatError, ToolCall, parse_messages, parse_tool_call, parse_tools, render_prompt, tool_grammar, tools_to_offer
from tokenmill.sampling.grammar import Grammar, GrammarError
from tokenmill.http.body import ApiError, read_json
from tokenmill.engine.sequence import FINISH_LENGTH, FinalResult, GenerationRequest, TokenEvent, TokenInfo
from tokenmill.http.validation import ValidationError, Validator

MAX_TOP_LOGPROBS = 20
"""OpenAI's limit on ``top_logprobs`` (chat); completions' ``logprobs`` stops at 5."""
MAX_COMPLETION_LOGPROBS = 5
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for ``/v1/completions``; chat defaults to the room left in the context."""

_MISSING = object()


# ---- reading OpenAI fields ---------------------------------------------------------------


def _field(body: dict[str, Any], name: str, kind: str) -> Any:
    """``body[name]`` checked to be of ``kind`` (number, integer, boolean, string, object); None when absent."""
    value = body.get(name)
    if value is None:
        return None
    ok = {
        "number": not isinstance(value, bool) and isinstance(value, (int, float))
        and math.isfinite(value),
        "integer": not isinstance(value, bool) and (isinstance(value, int)
                                                    or (isinstance(value, float) and value.is_integer())),
        "boolean": isinstance(value, bool),
        "string": isinstance(value, str),
        "object": isinstance(value, dict),
    }[kind]
    if not ok:
        article = "an" if kind[0] in "aeiou" else "a"
        raise ValidationError(f"`{name}` must be {article} {kind}, got {value!r}")
    return int(value) if kind == "integer" else value


def _stop_list(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise ValidationError("`stop` must be a string or a list of strings")


def sampling_parameters(body: dict[str, Any], default_max_tokens: int | None) -> dict[str, Any]:
    """OpenAI's sampling fields as TGI parameters. OpenAI samples at temperature 1 unless told
    otherwise; temperature 0 means greedy."""
    params: dict[str, Any] = {}
    temperature = _field(body, "temperature", "number")
    if temperature is not None and not 0 <= temperature <= 2:
        raise ValidationError(f"`temperature` must be between 0 and 2, got {temperature}")
    greedy = temperature == 0
    if not greedy:
        params["do_sample"] = True
        if temperature not in (None, 1):
            params["temperature"] = temperature
    top_p = _field(body, "top_p", "number")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValidationError(f"`top_p` must be > 0 and <= 1, got {top_p}")
    top_k = _field(body, "top_k", "integer")
    if not greedy:  # truncation would turn sampling back on
        if top_p is not None and top_p < 1:
            params["top_p"] = top_p
        if top_k is not None:
            params["top_k"] = top_k
    seed = _field(body, "seed", "integer")
    if seed is not None:
        params["seed"] = seed % 2**64  # OpenAI takes any 64-bit integer
    for name, tgi_name in (("presence_penalty", "presence_penalty"), ("frequency_penalty", "occurrence_penalty"),
                           ("repetition_penalty", "repetition_penalty")):
        value = _field(body, name, "number")
        if value:
            params[tgi_name] = value
    max_tokens = _field(body, "max_completion_tokens", "integer")
    if max_tokens is None:
        max_tokens = _field(body, "max_tokens", "integer")
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens is not None:
        if max_tokens <= 0:
            raise ValidationError(f"`max_tokens` must be at least 1, got {max_tokens}")
        params["max_new_tokens"] = max_tokens
    params["stop"] = _stop_list(body)
    if _field(body, "watermark", "boolean"):
        params["watermark"] = True
    if body.get("cache_salt") is not None:  # a top-level field, as vLLM takes it
        params["cache_salt"] = body["cache_salt"]
    return params


def choice_count(body: dict[str, Any], limit: int, prompts: int = 1) -> int:
    n = _field(body, "n", "integer")
    n = 1 if n is None else n
    if n < 1 or n * prompts > limit:
        raise ValidationError(f"`n` must be >= 1 and `n` × prompts <= {limit} (--max-client-batch-size); "
                              f"got n={n} for {prompts} prompt(s)")
    return n


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    options = _field(body, "stream_options", "object") or {}
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise ValidationError("`stream_options.include_usage` must be a boolean")
    return stream and include_usage


# ---- parsed requests -----------------------------------------------------------------------


@dataclass
class OpenAIJob:
    """What one OpenAI request asks the engine for: ``n`` sequences of each request, in choice order."""

    requests: list[GenerationRequest]
    n: int
    stream: bool
    include_usage: bool
    logprobs: bool
    model: str
    may_call_tool: bool = False
    """Whether the output may be a tool call (the route then parses it as one)."""
    echo: bool = False
    id: str = field(default_factory=lambda: secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))

    def sequences(self) -> list[tuple[GenerationRequest, int | None]]:
        """(request, seed) per choice; choice i of a seeded request gets seed + i, so choices differ."""
        jobs = []
        for request in self.requests:
            seed = request.sampling.seed
            jobs += [(request, None if seed is None else (seed + i) % 2**64) for i in range(self.n)]
        return jobs

    def cached_tokens(self, results: list[FinalResult | None]) -> int:
        """Prompt tokens served from the prefix cache, counted as the prompts are: once per prompt
        (its first choice's), whatever ``n``."""
        return sum(result.cached_tokens for result in results[:: self.n] if result is not None)

    def common(self, kind: str) -> dict[str, Any]:
        return {"id": f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{self.id}", "object": kind,
                "created": self.created, "model": self.model, "system_fingerprint": f"tokenmill-{__version__}"}


def parse_chat(validator: Validator, body: Any, model: str, priority: str | None) -> OpenAIJob:
    """A chat completion request, checked and tokenized (runs on the tokenizer thread)."""
    if not isinstance(body, dict):
        raise ValidationError("the request body must be a JSON object with `messages`")
    stream = bool(_field(body, "stream", "boolean"))
    config = validator.config
    try:
        messages = parse_messages(body.get("messages"))
        tools = parse_tools(body["tools"]) if body.get("tools") is not None else []
        offered, text_allowed = tools_to_offer(tools, body.get("tool_choice"))
        prompt = render_prompt(validator.tokenizer, messages, offered, text_allowed)
        grammar = tool_grammar(validator.grammars, offered, text_allowed) if offered else None
    except ChatError as error:
        raise ValidationError(str(error)) from None
    params = sampling_parameters(body, None)
    response_format = _field(body, "response_format", "object")
    if response_format is not None and response_format.get("type", "text") != "text":
        if grammar is not None:
            raise ValidationError("`response_format` and `tools` cannot constrain the same output; "
                                  'send one of them (or `tool_choice: "none"`)')
        params["grammar"], grammar = _response_format_grammar(validator, response_format)
    logprobs = bool(_field(body, "logprobs", "boolean"))
    top_logprobs = _field(body, "top_logprobs", "integer")
    if top_logprobs is not None:
        if not logprobs:
            raise ValidationError("`top_logprobs` needs `logprobs: true`")
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValidationError(f"`top_logprobs` must be between 0 and {MAX_TOP_LOGPROBS}, got {top_logprobs}")
        params["top_n_tokens"] = top_logprobs
    if priority is not None:
        params["priority"] = priority
    adapter = named_adapter(validator, body)
    if adapter:
        params["adapter_id"] = adapter
    n = choice_count(body, config.max_client_batch_size)
    request = validator.generate(prompt, params, stream, add_special_tokens=False, max_top_n=MAX_TOP_LOGPROBS,
                                 grammar=grammar)
    return OpenAIJob([request], n, stream, _stream_options(body, stream), logprobs, adapter or model,
                     may_call_tool=bool(offered))


def named_adapter(validator: Validator, body: dict[str, Any]) -> str | None:
    """The LoRA adapter that ``model`` names, else None: any other name means the base model, as
    clients written for one model send whatever name they were configured with."""
    model = body.get("model")
    served = validator.adapter_names() if validator.adapter_names is not None else []
    return model if isinstance(model, str) and model in served else None


def _response_format_grammar(validator: Validator, response_format: dict[str, Any]) -> tuple[dict[str, Any], Grammar]:
    """The response format as TGI's ``grammar`` parameter (what hooks see) and compiled, once, here,
    so that a broken schema is named by its field."""
    kind = response_format.get("type")
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ValidationError("`response_format.json_schema` must be an object with `name` and `schema`")
        schema = spec["schema"]
    else:
        raise ValidationError(f'`response_format.type` must be "text", "json_object" or "json_schema", got {kind!r}')
    try:
        return {"type": "json", "value": schema}, validator.grammars.json_schema(schema)
    except GrammarError as error:
        raise ValidationError(f"`response_format.json_schema.schema`: {error}") from None


def parse_completion(validator: Validator, body: Any, model: str, priority: str | None) -> OpenAIJob:
    """A completion request: one prompt or a list, each with ``n`` choices (tokenizer thread)."""
    if not isinstance(body, dict):
        raise ValidationError("the request body must be a JSON object with `prompt`")
    prompt = body.get("prompt", _MISSING)
    if prompt is _MISSING or prompt is None:
        raise ValidationError("missing field `prompt`")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValidationError("`prompt` must be a string or a non-empty list of strings (token-id prompts are not supported)")
    if body.get("suffix"):
        raise ValidationError("`suffix` is not supported")
    stream = bool(_field(body, "stream", "boolean"))
    echo = bool(_field(body, "echo", "boolean"))
    n = choice_count(body, validator.config.max_client_batch_size, len(prompts))
    best_of = _field(body, "best_of", "integer")
    if best_of not in (None, n):
        raise ValidationError("`best_of` other than `n` is not supported")
    params = sampling_parameters(body, COMPLETIONS_DEFAULT_MAX_TOKENS)
    logprobs = _field(body, "logprobs", "integer")
    if logprobs is not None:
        if not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
            raise ValidationError(f"`logprobs` must be between 0 and {MAX_COMPLETION_LOGPROBS}, got {logprobs}")
        params["top_n_tokens"] = logprobs
        if echo:
            if stream:
                raise ValidationError("`echo` with `logprobs` is not supported when streaming")
            params["decoder_input_details"] = True
    if priority is not None:
        params["priority"] = priority
    adapter = named_adapter(validator, body)
    if adapter:
        params["adapter_id"] = adapter
    requests = [validator.generate(text, params, stream, max_top_n=MAX_COMPLETION_LOGPROBS) for text in prompts]
    return OpenAIJob(requests, n, stream, _stream_options(body, stream), logprobs is not None, adapter or model,
                     echo=echo)


# ---- shaping responses ------------------------------------------------------------------------


def finish_reason(result: FinalResult, called: bool = False) -> str:
    if called:
        return "tool_calls"
    return "length" if result.finish_reason == FINISH_LENGTH else "stop"


def without_stop(text: str, stops: tuple[str, ...]) -> str:
    """OpenAI leaves the stop sequence out of the text (TGI keeps it)."""
    cuts = [text.find(stop) for stop in stops if stop in text]
    return text[: min(cuts)] if cuts else text


def usage_json(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_logprob(token: TokenInfo, top: list[TokenInfo]) -> dict[str, Any]:
    def entry(t: TokenInfo) -> dict[str, Any]:
        return {"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode())}

    return {**entry(token), "top_logprobs": [entry(t) for t in top]}


def chat_message(result: FinalResult, job: OpenAIJob, stops: tuple[str, ...]) -> tuple[dict[str, Any], ToolCall | None]:
    call = parse_tool_call(result.generated_text) if job.may_call_tool else None
    if call is not None:
        return {"role": "assistant", "content": None, "tool_calls": [call.as_json()]}, call
    return {"role": "assistant", "content": without_stop(result.generated_text, stops)}, None


def chat_completion_json(job: OpenAIJob, results: list[FinalResult]) -> dict[str, Any]:
    request = job.requests[0]
    choices = []
    for index, result in enumerate(results):
        message, call = chat_message(result, job, request.stop)
        logprobs = None
        if job.logprobs:
            logprobs = {"content": [chat_logprob(t, top) for t, top in
                                    zip(result.tokens, result.top_tokens or [[]] * len(result.tokens))
                                    if not t.special]}
        choices.append({"index": index, "message": message, "logprobs": logprobs,
                        "finish_reason": finish_reason(result, call is not None)})
    completion_tokens = sum(r.generated_tokens for r in results)
    return {**job.common("chat.completion"), "choices": choices,
            "usage": usage_json(len(request.input_ids), completion_tokens, job.cached_tokens(results))}


def completion_logprobs(tokens: list[TokenInfo], tops: list[list[TokenInfo]], start: int) -> dict[str, Any]:
    offsets, position = [], start
    for token in tokens:
        offsets.append(position)
        position += len(token.text)
    return {"tokens": [t.text for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [({t.text: t.logprob for t in top} if top else None) for top in tops],
            "text_offset": offsets}


def completion_json(job: OpenAIJob, results: list[FinalResult]) -> dict[str, Any]:
    choices = []
    for index, result in enumerate(results):
        request = job.requests[index // job.n]
        text = without_stop(result.generated_text, request.stop)
        logprobs = None
        if job.logprobs:
            tokens = [t for t in result.tokens if not t.special]
            tops = [top for t, top in zip(result.tokens, result.top_tokens) if not t.special]
            start = len(request.inputs) if job.echo else 0
            logprobs = completion_logprobs(tokens, tops, start)
            if job.echo:
                prompt = completion_logprobs(result.prefill, [[] for _ in result.prefill], 0)
                logprobs = {key: prompt[key] + logprobs[key] for key in logprobs}
        choices.append({"index": index, "text": (request.inputs if job.echo else "") + text,
                        "logprobs": logprobs, "finish_reason": finish_reason(result)})
    prompt_tokens = sum(len(r.input_ids) for r in job.requests)
    return {**job.common("text_completion"), "choices": choices,
            "usage": usage_json(prompt_tokens, sum(r.generated_tokens for r in results), job.cached_tokens(results))}


class StopHoldback:
    """Streams text without the stop sequence: holds back any tail that could begin one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.pending = ""
        self.stopped = False

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return text
        self.pending += text
        cut = without_stop(self.pending, self.stops)
        if len(cut) < len(self.pending):
            self.stopped, self.pending = True, ""
            return cut
        keep = max((k for stop in self.stops for k in range(1, len(stop)) if self.pending.endswith(stop[:k])),
                   default=0)
        ready, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return ready

    def finish(self) -> str:
        rest, self.pending = ("" if self.stopped else self.pending), ""
        return rest


class ChoiceStream:
    """Turns one choice's token events into OpenAI stream chunks (chat or completion)."""

    def __init__(self, job: OpenAIJob, index: int, chat: bool) -> None:
        self.job, self.index, self.chat = job, index, chat
        self.request = job.requests[index // job.n]
        self.holdback = StopHoldback(self.request.stop)
        self.buffering = job.may_call_tool
        """A tool call is sent whole at the end; text answers stream once the first character shows it is text."""
        self.buffered = ""
        self.offset = 0
        """Characters of this choice's text sent so far (completions' ``text_offset``)."""

    def opening(self) -> dict[str, Any] | None:
        if self.chat:
            return self._chunk({"role": "assistant", "content": ""}, None, None)
        if self.job.echo:
            self.offset = len(self.request.inputs)
            return self._text_chunk(self.request.inputs, None, None)
        return None

    def on_token(self, event: TokenEvent) -> list[dict[str, Any]]:
        token = event.token
        text = "" if token.special else self.holdback.push(token.text)
        if event.final is not None:
            text += self.holdback.finish()
        chunks = []
        logprobs = self._logprobs(event) if self.job.logprobs and not token.special else None
        if self.buffering:
            self.buffered += text
            if self.buffered.strip():
                self.buffering = self.buffered.lstrip().startswith("{")
                if not self.buffering:
                    text, self.buffered = self.buffered, ""
        if not self.buffering and (text or logprobs):
            chunks.append(self._text_chunk(text, logprobs, None))
        if event.final is not None:
            chunks += self._closing(event.final)
        return chunks

    def _closing(self, final: FinalResult) -> list[dict[str, Any]]:
        call = parse_tool_call(self.buffered) if self.buffering else None
        if call is not None:
            delta = {"tool_calls": [{"index": 0, **call.as_json()}]}
            return [self._chunk(delta, None, None), self._chunk({}, None, finish_reason(final, True))]
        chunks = [self._text_chunk(self.buffered, None, None)] if self.buffered else []
        return chunks + [self._text_chunk("", None, finish_reason(final))]

    def _text_chunk(self, text: str, logprobs: Any, reason: str | None) -> dict[str, Any]:
        if self.chat:
            return self._chunk({"content": text} if text or not reason else {}, logprobs, reason)
        return {**self.job.common("text_completion"),
                "choices": [{"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": reason}]}

    def _chunk(self, delta: dict[str, Any], logprobs: Any, reason: str | None) -> dict[str, Any]:
        return {**self.job.common("chat.completion.chunk"),
                "choices": [{"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]}

    def _logprobs(self, event: TokenEvent) -> Any:
        if self.chat:
            return {"content": [chat_logprob(event.token, event.top_tokens)]}
        logprobs = completion_logprobs([event.token], [event.top_tokens], self.offset)
        self.offset += len(event.token.text)
        return logprobs


# ---- routes ----------------------------------------------------------------------------------


class OpenAIRoute:
    """Shared by the two generation routes: parse on the tokenizer thread, then answer whole or stream."""

    chat: bool

    def __init__(self, generation: Any) -> None:
        self.generation = generation

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        generation = self.generation
        state = generation.state
        state.ready_engine()
        body = await read_json(req, state.config.payload_limit)
        priority = req.get_header("X-Priority")
        parse = parse_chat if self.chat else parse_completion
        try:
            job = await generation.validate(parse, generation.validator(), body, served_model(state),
                                            priority.strip().lower() if priority else None)
        except ValidationError as error:
            raise ApiError(422, str(error), "validation") from None
        if job.stream:
            await generation.stream_openai(req, resp, job, OpenAIStream(job, self.chat))
            return
        results = await generation.run_openai(req, resp, job)
        resp.media = chat_completion_json(job, results) if self.chat else completion_json(job, results)


class ChatCompletionsRoute(OpenAIRoute):
    chat = True


class CompletionsRoute(OpenAIRoute):
    chat = False


class OpenAIStream:
    """The SSE events of a streamed OpenAI response, from the (choice, event) pairs of its sequences."""

    def __init__(self, job: OpenAIJob, chat: bool) -> None:
        self.job = job
        self.choices = [ChoiceStream(job, i, chat) for i in range(len(job.requests) * job.n)]
        self.completion_tokens = 0
        self.finals: list[FinalResult | None] = [None] * len(self.choices)

    def opening(self) -> list[dict[str, Any]]:
        return [chunk for choice in self.choices if (chunk := choice.opening()) is not None]

    def on_event(self, index: int, event: TokenEvent) -> list[dict[str, Any]]:
        self.completion_tokens += 1
        if event.final is not None:
            self.finals[index] = event.final
        chunks = self.choices[index].on_token(event)
        if self.job.include_usage:
            for chunk in chunks:
                chunk["usage"] = None
        return chunks

    def closing(self) -> list[dict[str, Any]]:
        if not self.job.include_usage:
            return []
        prompt_tokens = sum(len(r.input_ids) for r in self.job.requests)
        kind = "chat.completion.chunk" if self.choices[0].chat else "text_completion"
        usage = usage_json(prompt_tokens, self.completion_tokens, self.job.cached_tokens(self.finals))
        return [{**self.job.common(kind), "choices": [], "usage": usage}]


def served_model(state: Any) -> str:
    loaded = state.loaded
    return loaded.model_id if loaded is not None else (state.config.model_id or "tokenmill")


class ModelsRoute:
    def __init__(self, state: Any) -> None:
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


async def sse_events(events: AsyncIterator[dict[str, Any] | None]) -> AsyncIterator[falcon.asgi.SSEvent]:
    """Each chunk as an SSE ``data:`` event, then ``data: [DONE]`` once the stream ends normally."""
    async for chunk in events:
        if chunk is None:
            yield falcon.asgi.SSEvent(data=b"[DONE]")
            return
        yield falcon.asgi.SSEvent(data=json.dumps(chunk).encode())
