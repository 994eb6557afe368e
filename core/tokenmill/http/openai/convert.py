"""OpenAI's requests, their shapes checked by their models, converted into TGI's: :func:`to_generate`
turns the sampling fields into :class:`GenerateParameters`, the one shape validation reads; chat
renders its prompt through the template, completions read their prompts. ``n`` choices are ``n``
sequences of one request."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill import __version__
from tokenmill.engine.sequence import FinalResult, GenerationRequest
from tokenmill.http.context import Caller
from tokenmill.http.images import placeholder
from tokenmill.http.openai.chat import (
    ChatError,
    Tool,
    message_images,
    parse_messages,
    parse_tools,
    render_prompt,
    template_kwargs,
    tool_grammar,
    tools_to_offer,
)
from tokenmill.http.openai.reading import ChatFormat, OutputFormat
from tokenmill.http.openai.schemas import ChatRequest, CompletionRequest, SamplingFields
from tokenmill.http.openai.structured import Constraint, output_constraint
from tokenmill.http.schemas import ValidationError, check_body
from tokenmill.http.tgi.schemas import GenerateParameters
from tokenmill.http.tgi.validation import Validator, token_id_prompt
from tokenmill.sampling.grammar import Grammar

MAX_TOP_LOGPROBS = 20
"""OpenAI's limit on ``top_logprobs`` (chat); completions' ``logprobs`` stops at 5."""

MAX_COMPLETION_LOGPROBS = 5

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for ``/v1/completions``; chat defaults to the room left in the context."""

PASSED_AS_THEY_ARE = ("presence_penalty", "repetition_penalty", "min_p", "min_tokens", "ignore_eos",
                      "stop_token_ids", "cache_salt")
"""Fields that mean the same in TGI's parameters (vLLM's extras among them). ``min_p`` does not turn
sampling on: at ``temperature`` 0 it changes nothing, as in vLLM."""


def to_generate(request: SamplingFields, max_tokens: int | None, **routing: Any) -> GenerateParameters:
    """The request's sampling fields as TGI's parameters, with ``routing`` (priority, adapter, grammar,
    top tokens) added. OpenAI samples at temperature 1 unless told otherwise; temperature 0 means
    greedy. ``top_p`` 1 keeps every token, as no ``top_p`` does (TGI's spec allows only < 1)."""
    params: dict[str, Any] = {name: getattr(request, name) for name in PASSED_AS_THEY_ARE
                              if getattr(request, name) is not None}
    if request.temperature != 0:  # at 0 (greedy) no truncation is passed on: it would turn sampling back on
        params["do_sample"] = True
        if request.temperature not in (None, 1):
            params["temperature"] = request.temperature
        if request.top_p is not None and request.top_p < 1:
            params["top_p"] = request.top_p
        if request.top_k is not None:
            params["top_k"] = request.top_k
    if request.seed is not None:
        params["seed"] = request.seed % 2**64  # OpenAI takes any 64-bit integer
    if request.frequency_penalty:
        params["occurrence_penalty"] = request.frequency_penalty
    if max_tokens is not None:
        if max_tokens <= 0:
            raise ValidationError(f"`max_tokens` must be at least 1, got {max_tokens}")
        params["max_new_tokens"] = max_tokens
    params["stop"] = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if request.watermark:
        params["watermark"] = True
    if isinstance(request.logit_bias, dict) and request.logit_bias:  # TGI's list form names no tokens: unused
        params["logit_bias"] = request.logit_bias
    return check_body(GenerateParameters, {**params, **routing})


def choice_count(n: int | None, limit: int, prompts: int = 1) -> int:
    """``n`` (default 1), within ``n`` × prompts <= ``--max-client-batch-size``."""
    n = 1 if n is None else n
    if n * prompts > limit:
        raise ValidationError(f"`n` must be >= 1 and `n` × prompts <= {limit} (--max-client-batch-size); "
                              f"got n={n} for {prompts} prompt(s)")
    return n


def routing(validator: Validator, request: SamplingFields, caller: Caller) -> tuple[dict[str, Any], str | None]:
    """The TGI parameters that say where the request goes: its priority class (from ``X-Priority``)
    and the LoRA adapter its ``model`` names, which is returned too (None: the base model; any other
    name means the base model, as clients written for one model send whatever name they were given)."""
    params: dict[str, Any] = {} if caller.priority is None else {"priority": caller.priority}
    adapter = validator.served_adapter(request.model)
    if adapter:
        params["adapter_id"] = adapter
    return params, adapter


@dataclass
class OpenAIJob:
    """What one OpenAI request asks the engine for: ``n`` sequences of each request, in choice order."""

    requests: list[GenerationRequest]
    n: int
    stream: bool
    include_usage: bool
    logprobs: bool
    model: str
    output: OutputFormat = field(default_factory=OutputFormat)
    """How a chat output is read: its reasoning and its tool calls (nothing to read by default)."""
    echo: bool = False
    scores_prompt: bool = False
    """``max_tokens: 0`` with ``echo``: the prompt is scored and nothing is generated (one token is,
    and left out of the response)."""
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


@dataclass(frozen=True)
class RenderedChat:
    """A chat request's prompt, and the tools it offers the output."""

    prompt: str
    offered: list[Tool]
    text_allowed: bool
    native: bool
    """Whether the chat template shows the tools and the model calls them in its own format."""
    parallel: bool


def render_chat(validator: Validator, request: ChatRequest, chat_format: ChatFormat) -> RenderedChat:
    """The prompt the chat template makes of ``request``, its tools shown as ``chat_format`` says."""
    parallel = request.parallel_tool_calls is not False  # OpenAI's and vLLM's default
    try:
        image = placeholder(validator.vision)
        messages = parse_messages(request.messages, image)
        offered, text_allowed = tools_to_offer(parse_tools(request.tools or []), request.tool_choice)
        native = bool(offered) and text_allowed and chat_format.native_tools
        variables = template_kwargs(validator.tokenizer, request.chat_template_kwargs)
        prompt = render_prompt(validator.tokenizer, messages, offered, text_allowed, parallel, variables,
                               request.tool_prompt, native=native, placeholder=image)
    except ChatError as error:
        raise ValidationError(str(error)) from None
    return RenderedChat(prompt, offered, text_allowed, native, parallel)


def parse_chat(validator: Validator, request: ChatRequest, model: str, caller: Caller,
               chat_format: ChatFormat) -> OpenAIJob:
    """A chat completion request, rendered and tokenized (runs on a validation worker). Tools offered
    with ``tool_choice`` ``auto`` are shown by the chat template and read by the server's tool parser
    when it reads the model's own format; otherwise (``required``, a named function, or the ``tgi``
    parser) the output is held to the JSON-calls grammar."""
    chat = render_chat(validator, request, chat_format)
    prompt, offered, parallel = chat.prompt, chat.offered, chat.parallel
    try:
        grammar = (tool_grammar(validator.grammars, offered, chat.text_allowed, parallel)
                   if offered and not chat.native else None)
    except ChatError as error:
        raise ValidationError(str(error)) from None
    extra, adapter = routing(validator, request, caller)
    constraint = output_constraint(validator.grammars, request)
    if constraint is not None:
        if offered:
            raise ValidationError(f"`{constraint.field}` and `tools` cannot constrain the same output; "
                                  'send one of them (or `tool_choice: "none"`)')
        grammar = constrained(extra, constraint)
    max_top_n = min(MAX_TOP_LOGPROBS, validator.config.max_top_n_tokens)
    if request.top_logprobs is not None:
        if not request.logprobs:
            raise ValidationError("`top_logprobs` needs `logprobs: true`")
        if request.top_logprobs > max_top_n:
            raise ValidationError(f"`top_logprobs` must be between 0 and {max_top_n} (--max-top-n-tokens), "
                                  f"got {request.top_logprobs}")
        extra["top_n_tokens"] = request.top_logprobs
    n = choice_count(request.n, validator.config.max_client_batch_size)
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    params = to_generate(request, max_tokens, **extra)
    reasoning = chat_format.reasoning
    if grammar is not None and reasoning is not None and reasoning.thinks(prompt):
        grammar = validator.grammars.after_free_text(grammar, reasoning.end)  # the answer, not the thinking
    generation = validator.generate(prompt, params, request.stream, add_special_tokens=False, max_top_n=max_top_n,
                                    grammar=grammar, tenant=caller.tenant, image_urls=message_images(request.messages))
    output = OutputFormat(tuple(offered), (chat_format.tool_parser if chat.native else chat_format.forced) if offered
                          else None, reasoning, reasoning is not None and reasoning.starts_reasoning(prompt), parallel)
    return OpenAIJob([generation], n, request.stream, include_usage(request), bool(request.logprobs),
                     adapter or model, output=output)


def constrained(params: dict[str, Any], constraint: Constraint) -> Grammar:
    """The constraint's grammar; its statement as TGI's ``grammar`` parameter goes into ``params`` (what
    hooks see), when TGI's parameter can state it."""
    if constraint.parameter is not None:
        params["grammar"] = constraint.parameter
    return constraint.grammar


def include_usage(request: SamplingFields) -> bool:
    return request.stream and request.stream_options is not None and request.stream_options.include_usage


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """OpenAI's four forms of prompt (a string, a list of token ids, or a non-empty list of either:
    a batch) as a list of prompts, each a text or token ids; nothing is decoded yet."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ValidationError("`prompt` must be a string, a list of token ids, or a non-empty list of either")
    return list(prompt) if isinstance(prompt[0], (str, list)) else [prompt]  # type: ignore[list-item]


def parse_completion(validator: Validator, request: CompletionRequest, model: str, caller: Caller) -> OpenAIJob:
    """A completion request: one prompt or a list, each with ``n`` choices (on a validation worker).
    ``max_tokens: 0`` with ``echo`` (a scorer's request, as vLLM takes it) scores the prompt: one token
    is generated and left out of the response."""
    prompts = completion_prompts(request.prompt)
    n = choice_count(request.n, validator.config.max_client_batch_size, len(prompts))  # before any decoding
    if request.suffix:
        raise ValidationError("`suffix` is not supported")
    if request.best_of not in (None, n):
        raise ValidationError("`best_of` other than `n` is not supported")
    stream, echo, max_tokens = request.stream, bool(request.echo), request.max_tokens
    scoring = echo and max_tokens == 0
    if scoring:
        if stream:
            raise ValidationError("`max_tokens: 0` (scoring the echoed prompt) is not supported when streaming")
        max_tokens = 1
    extra, adapter = routing(validator, request, caller)
    constraint = output_constraint(validator.grammars, request)
    grammar = constrained(extra, constraint) if constraint is not None else None
    max_top_n = min(MAX_COMPLETION_LOGPROBS, validator.config.max_top_n_tokens)
    if request.logprobs is not None:
        if request.logprobs > max_top_n:
            raise ValidationError(f"`logprobs` must be between 0 and {max_top_n} (--max-top-n-tokens), "
                                  f"got {request.logprobs}")
        extra["top_n_tokens"] = request.logprobs
        if echo:
            if stream:
                raise ValidationError("`echo` with `logprobs` is not supported when streaming")
            extra["decoder_input_details"] = True
    params = to_generate(request, COMPLETIONS_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens, **extra)
    requests = []
    for prompt in prompts:
        ids = None if isinstance(prompt, str) else token_id_prompt(prompt, validator.vocab_size)
        text = prompt if isinstance(prompt, str) else validator.tokenizer.decode(ids)
        requests.append(validator.generate(text, params, stream, max_top_n=max_top_n, input_ids=ids, grammar=grammar,
                                           tenant=caller.tenant))
    return OpenAIJob(requests, n, stream, include_usage(request), request.logprobs is not None, adapter or model,
                     echo=echo, scores_prompt=scoring)
