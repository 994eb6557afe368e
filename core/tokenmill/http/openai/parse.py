"""OpenAI's request bodies read into engine requests: each body is translated into TGI's
parameters and goes through the same validation; ``n`` choices are ``n`` sequences of one
request. Unknown fields are ignored as OpenAI's server does; a known field of the wrong type is
a 422 that names it."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill import __version__
from tokenmill.engine.sequence import FinalResult, GenerationRequest
from tokenmill.http.fields import MISSING, ValidationError, is_number, typed_field
from tokenmill.http.openai.chat import (
    ChatError,
    parse_messages,
    parse_tools,
    render_prompt,
    template_kwargs,
    tool_grammar,
    tools_to_offer,
)
from tokenmill.http.validation import Validator, token_id_prompt
from tokenmill.sampling.grammar import Grammar, GrammarError, grammar_from_parameter

MAX_TOP_LOGPROBS = 20
"""OpenAI's limit on ``top_logprobs`` (chat); completions' ``logprobs`` stops at 5."""


MAX_COMPLETION_LOGPROBS = 5


COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for ``/v1/completions``; chat defaults to the room left in the context."""


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
    temperature = typed_field(body, "temperature", "number")
    if temperature is not None and not 0 <= temperature <= 2:
        raise ValidationError(f"`temperature` must be between 0 and 2, got {temperature}")
    greedy = temperature == 0
    if not greedy:
        params["do_sample"] = True
        if temperature not in (None, 1):
            params["temperature"] = temperature
    top_p = typed_field(body, "top_p", "number")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValidationError(f"`top_p` must be > 0 and <= 1, got {top_p}")
    top_k = typed_field(body, "top_k", "integer")
    if not greedy:  # truncation would turn sampling back on
        if top_p is not None and top_p < 1:
            params["top_p"] = top_p
        if top_k is not None:
            params["top_k"] = top_k
    seed = typed_field(body, "seed", "integer")
    if seed is not None:
        if not -(2**63) <= seed < 2**64:
            raise ValidationError(f"`seed` must be a 64-bit integer (signed or not), got {seed}")
        params["seed"] = seed % 2**64  # OpenAI takes any 64-bit integer
    for name, tgi_name in (("presence_penalty", "presence_penalty"), ("frequency_penalty", "occurrence_penalty"),
                           ("repetition_penalty", "repetition_penalty")):
        value = typed_field(body, name, "number")
        if value:
            params[tgi_name] = value
    max_tokens = typed_field(body, "max_completion_tokens", "integer")
    if max_tokens is None:
        max_tokens = typed_field(body, "max_tokens", "integer")
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens is not None:
        if max_tokens <= 0:
            raise ValidationError(f"`max_tokens` must be at least 1, got {max_tokens}")
        params["max_new_tokens"] = max_tokens
    params["stop"] = _stop_list(body)
    if typed_field(body, "watermark", "boolean"):
        params["watermark"] = True
    if body.get("cache_salt") is not None:  # a top-level field, as vLLM takes it
        params["cache_salt"] = body["cache_salt"]
    bias = _logit_bias(body)
    if bias:
        params["logit_bias"] = bias
    for name in VLLM_SAMPLING_FIELDS:  # TGI's validation reads them as they are, naming any that is wrong
        if body.get(name) is not None:
            params[name] = body[name]
    return params


VLLM_SAMPLING_FIELDS = ("min_p", "min_tokens", "ignore_eos", "stop_token_ids")
"""Extra body fields vLLM's OpenAI server takes, passed to TGI's parameters under the same names.
``min_p`` does not turn sampling on: at ``temperature`` 0 it changes nothing, as in vLLM."""


def _logit_bias(body: dict[str, Any]) -> dict[str, Any] | None:
    """OpenAI's map of token id to bias, to apply (validation checks its ids and bounds); the list of
    biases TGI's spec also allows has no token ids, so it is checked and, as TGI does, left unused."""
    bias = body.get("logit_bias")
    if isinstance(bias, dict):
        return bias
    if bias is not None and not (isinstance(bias, list) and all(is_number(v) for v in bias)):
        raise ValidationError("`logit_bias` must be an object of token ids to numbers")
    return None


def choice_count(body: dict[str, Any], limit: int, prompts: int = 1) -> int:
    n = typed_field(body, "n", "integer")
    n = 1 if n is None else n
    if n < 1 or n * prompts > limit:
        raise ValidationError(f"`n` must be >= 1 and `n` × prompts <= {limit} (--max-client-batch-size); "
                              f"got n={n} for {prompts} prompt(s)")
    return n


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    options = typed_field(body, "stream_options", "object") or {}
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise ValidationError("`stream_options.include_usage` must be a boolean")
    return stream and include_usage


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


def parse_chat(validator: Validator, body: Any, model: str, priority: str | None) -> OpenAIJob:
    """A chat completion request, checked and tokenized (runs on the tokenizer thread)."""
    if not isinstance(body, dict):
        raise ValidationError("the request body must be a JSON object with `messages`")
    stream = bool(typed_field(body, "stream", "boolean"))
    config = validator.config
    lead_in = typed_field(body, "tool_prompt", "string")  # TGI's words before the tools
    # Several calls only when asked for: TGI makes one, and small models asked once call twice.
    parallel = typed_field(body, "parallel_tool_calls", "boolean") is True
    _logit_bias(body)
    try:
        messages = parse_messages(body.get("messages"))
        tools = parse_tools(body["tools"]) if body.get("tools") is not None else []
        offered, text_allowed = tools_to_offer(tools, body.get("tool_choice"))
        variables = template_kwargs(validator.tokenizer, body.get("chat_template_kwargs"))
        prompt = render_prompt(validator.tokenizer, messages, offered, text_allowed, parallel, variables, lead_in)
        grammar = tool_grammar(validator.grammars, offered, text_allowed, parallel) if offered else None
    except ChatError as error:
        raise ValidationError(str(error)) from None
    params = sampling_parameters(body, None)
    response_format = typed_field(body, "response_format", "object")
    if response_format is not None and "type" not in response_format:
        raise ValidationError("`response_format` must have a `type`")
    if response_format is not None and response_format["type"] != "text":
        if grammar is not None:
            raise ValidationError("`response_format` and `tools` cannot constrain the same output; "
                                  'send one of them (or `tool_choice: "none"`)')
        params["grammar"], grammar = _response_format_grammar(validator, response_format)
    logprobs = bool(typed_field(body, "logprobs", "boolean"))
    top_logprobs = typed_field(body, "top_logprobs", "integer")
    if top_logprobs is not None:
        if not logprobs:
            raise ValidationError("`top_logprobs` needs `logprobs: true`")
        limit = min(MAX_TOP_LOGPROBS, validator.config.max_top_n_tokens)
        if not 0 <= top_logprobs <= limit:
            raise ValidationError(f"`top_logprobs` must be between 0 and {limit} (--max-top-n-tokens), "
                                  f"got {top_logprobs}")
        params["top_n_tokens"] = top_logprobs
    adapter = route(params, validator, body, priority)
    n = choice_count(body, config.max_client_batch_size)
    request = validator.generate(prompt, params, stream, add_special_tokens=False,
                                 max_top_n=min(MAX_TOP_LOGPROBS, validator.config.max_top_n_tokens),
                                 grammar=grammar)
    return OpenAIJob([request], n, stream, _stream_options(body, stream), logprobs, adapter or model,
                     may_call_tool=bool(offered))


def named_adapter(validator: Validator, body: dict[str, Any]) -> str | None:
    """The LoRA adapter that ``model`` names, else None: any other name means the base model, as
    clients written for one model send whatever name they were configured with."""
    return validator.served_adapter(typed_field(body, "model", "string"))


def route(params: dict[str, Any], validator: Validator, body: dict[str, Any], priority: str | None) -> str | None:
    """Set the TGI ``params`` that say where the request goes: its priority class (from ``X-Priority``)
    and the LoRA adapter its ``model`` names, which is returned (None: the base model)."""
    if priority is not None:
        params["priority"] = priority
    adapter = named_adapter(validator, body)
    if adapter:
        params["adapter_id"] = adapter
    return adapter


def _response_format_grammar(validator: Validator, response_format: dict[str, Any]) -> tuple[dict[str, Any], Grammar]:
    """The response format as TGI's ``grammar`` parameter (what hooks see) and compiled, once, here,
    so that a broken schema is named by its field. OpenAI's formats, and TGI's own (its ``grammar``
    parameter, ``{"type": "json" | "regex" | "json_schema", "value": ...}``, as its spec documents
    ``response_format`` and huggingface_hub sends it)."""
    kind = response_format.get("type")
    named = response_format.get("json_schema", response_format.get("value")) if kind == "json_schema" else None
    if isinstance(named, dict) and named.get("name") is not None and not isinstance(named["name"], str):
        raise ValidationError("`response_format`: the schema's `name` must be a string")
    if kind in ("json", "regex") or (kind == "json_schema" and "json_schema" not in response_format):
        try:
            return response_format, grammar_from_parameter(validator.grammars, response_format)
        except GrammarError as error:
            message = str(error).replace("`grammar", "`response_format", 1)
            raise ValidationError(message if message.startswith("`") else f"`response_format`: {message}") from None
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ValidationError("`response_format.json_schema` must be an object with `name` and `schema`")
        schema = spec["schema"]
    else:
        raise ValidationError(f'`response_format.type` must be "text", "json_object" or "json_schema" (or TGI\'s '
                              f'"json" or "regex"), got {kind!r}')
    try:
        return {"type": "json", "value": schema}, validator.grammars.json_schema(schema)
    except GrammarError as error:
        raise ValidationError(f"`response_format.json_schema.schema`: {error}") from None


def completion_prompts(validator: Validator, prompt: Any) -> list[tuple[str, list[int] | None]]:
    """Each prompt of a completion request as (text, token ids or None for a text prompt). OpenAI's
    four forms: a string, a list of token ids, or a non-empty list of either (a batch); a token-id
    prompt runs as given (no special tokens added), its text is what it decodes to."""
    if isinstance(prompt, str):
        return [(prompt, None)]
    if not isinstance(prompt, list) or not prompt:
        raise ValidationError("`prompt` must be a string, a list of token ids, or a non-empty list of either")
    items = prompt if isinstance(prompt[0], (str, list)) else [prompt]
    prompts: list[tuple[str, list[int] | None]] = []
    for item in items:
        if isinstance(item, str):
            prompts.append((item, None))
        elif isinstance(item, list):
            ids = token_id_prompt(item, validator.vocab_size)
            prompts.append((validator.tokenizer.decode(ids), ids))
        else:
            raise ValidationError("a list of prompts must hold strings or lists of token ids only, "
                                  f"got {type(item).__name__}")
    return prompts


def _scores_prompt(body: dict[str, Any], echo: bool) -> dict[str, Any] | None:
    """For ``max_tokens: 0`` with ``echo`` (a scorer's request, as vLLM takes it): the body asking for
    one token instead, which the response leaves out; None for any other body."""
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(key)
    if not echo or type(value) is not int or value != 0:
        return None
    return {**body, key: 1}


def parse_completion(validator: Validator, body: Any, model: str, priority: str | None) -> OpenAIJob:
    """A completion request: one prompt or a list, each with ``n`` choices (tokenizer thread)."""
    if not isinstance(body, dict):
        raise ValidationError("the request body must be a JSON object with `prompt`")
    prompt = body.get("prompt", MISSING)
    if prompt is MISSING or prompt is None:
        raise ValidationError("missing field `prompt`")
    prompts = completion_prompts(validator, prompt)
    if typed_field(body, "suffix", "string"):
        raise ValidationError("`suffix` is not supported")
    stream = bool(typed_field(body, "stream", "boolean"))
    echo = bool(typed_field(body, "echo", "boolean"))
    scoring = _scores_prompt(body, echo)
    if scoring is not None:
        if stream:
            raise ValidationError("`max_tokens: 0` (scoring the echoed prompt) is not supported when streaming")
        body = scoring
    n = choice_count(body, validator.config.max_client_batch_size, len(prompts))
    best_of = typed_field(body, "best_of", "integer")
    if best_of not in (None, n):
        raise ValidationError("`best_of` other than `n` is not supported")
    params = sampling_parameters(body, COMPLETIONS_DEFAULT_MAX_TOKENS)
    logprobs = typed_field(body, "logprobs", "integer")
    if logprobs is not None:
        limit = min(MAX_COMPLETION_LOGPROBS, validator.config.max_top_n_tokens)
        if not 0 <= logprobs <= limit:
            raise ValidationError(f"`logprobs` must be between 0 and {limit} (--max-top-n-tokens), got {logprobs}")
        params["top_n_tokens"] = logprobs
        if echo:
            if stream:
                raise ValidationError("`echo` with `logprobs` is not supported when streaming")
            params["decoder_input_details"] = True
    adapter = route(params, validator, body, priority)
    limit = min(MAX_COMPLETION_LOGPROBS, validator.config.max_top_n_tokens)
    requests = [validator.generate(text, params, stream, max_top_n=limit, input_ids=ids) for text, ids in prompts]
    return OpenAIJob(requests, n, stream, _stream_options(body, stream), logprobs is not None, adapter or model,
                     echo=echo, scores_prompt=scoring is not None)
