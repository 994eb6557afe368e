"""Request validation: TGI's parameter rules, each failure a 422 naming the parameter."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from tokenmill.config import Config
from tokenmill.engine.sequence import PRIORITY_CLASSES, GenerationRequest, SamplingParams
from tokenmill.http.fields import ValidationError, is_number, typed_field
from tokenmill.http.schemas.tgi import MAX_STOP_TOKEN_IDS
from tokenmill.sampling.grammar import Grammar, GrammarCompiler, GrammarError, grammar_from_parameter
from tokenmill.sampling.sampler import uses_sampling

MAX_STOP_CHARACTERS = 512
"""The longest stop sequence a request may give (matched as text, one character at a time)."""


GRAMMARS_DISABLED = ("grammar support is disabled on this server (--disable-grammar-support): no `grammar`, "
                     "JSON `response_format` or tools")

MAX_LOGIT_BIAS = 100.0
"""OpenAI's bound on a token's bias either way (100 all but forces the token, -100 bans it)."""


def logit_bias(value: Any, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` map (token id, as a string, to a bias in [-100, 100]) as sorted pairs;
    a token named twice ("5" and "05") keeps its last bias."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise ValidationError(f"`logit_bias` must be an object of token ids to biases, got {value!r}")
    biases: dict[int, float] = {}
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and re.fullmatch("[0-9]{1,12}", key) else None
        if token is None or (vocab_size is not None and token >= vocab_size):
            limit = f" below {vocab_size}" if vocab_size is not None else ""
            raise ValidationError(f"`logit_bias` keys must be token ids{limit}, got {key!r}")
        if not is_number(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise ValidationError(f"`logit_bias` values must be numbers between -100 and 100, got {bias!r} "
                                  f"for token {token}")
        biases[token] = float(bias)
    return tuple(sorted(biases.items()))


def stop_token_ids(value: Any, vocab_size: int) -> tuple[int, ...]:
    """vLLM's ``stop_token_ids``: a list of token ids of this model."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise ValidationError(f"`stop_token_ids` must be a list of integers, got {value!r}")
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise ValidationError(f"`stop_token_ids` holds at most {MAX_STOP_TOKEN_IDS} ids, got {len(value)}")
    if any(not 0 <= i < vocab_size for i in value):
        raise ValidationError(f"`stop_token_ids` must be token ids >= 0 and < {vocab_size}, got {value!r}")
    return tuple(dict.fromkeys(value))


def sampling_params(params: dict[str, Any], vocab_size: int | None = None) -> SamplingParams:
    """TGI's sampling parameters checked, with vLLM's ``min_p`` and OpenAI's ``logit_bias`` (whose
    token ids are checked against ``vocab_size`` when given)."""
    temperature = typed_field(params, "temperature", "number")
    if temperature is not None and temperature <= 0:
        raise ValidationError("`temperature` must be strictly positive")
    repetition_penalty = typed_field(params, "repetition_penalty", "number")
    if repetition_penalty is not None and repetition_penalty <= 0:
        raise ValidationError("`repetition_penalty` must be strictly positive")
    frequency_penalty = typed_field(params, "frequency_penalty", "number")
    if frequency_penalty is not None and not -2.0 <= frequency_penalty <= 2.0:
        raise ValidationError("`frequency_penalty` must be >= -2.0 and <= 2.0")
    top_p = typed_field(params, "top_p", "number")
    if top_p is not None and not 0.0 < top_p < 1.0:
        raise ValidationError("`top_p` must be > 0.0 and < 1.0")
    typical_p = typed_field(params, "typical_p", "number")
    if typical_p is not None and not 0.0 < typical_p < 1.0:
        raise ValidationError("`typical_p` must be > 0.0 and < 1.0")
    top_k = typed_field(params, "top_k", "integer")
    if top_k is not None and top_k <= 0:
        raise ValidationError("`top_k` must be strictly positive")
    seed = typed_field(params, "seed", "integer")
    if seed is not None and not 0 <= seed < 2**64:
        raise ValidationError("`seed` must be >= 0 and < 2^64")
    presence_penalty = typed_field(params, "presence_penalty", "number")
    occurrence_penalty = typed_field(params, "occurrence_penalty", "number")
    for name, value in (("presence_penalty", presence_penalty), ("occurrence_penalty", occurrence_penalty)):
        if value is not None and not -2.0 <= value <= 2.0:
            raise ValidationError(f"`{name}` must be >= -2.0 and <= 2.0")
    min_p = typed_field(params, "min_p", "number")
    if min_p is not None and not 0.0 <= min_p <= 1.0:
        raise ValidationError("`min_p` must be >= 0.0 and <= 1.0")
    return SamplingParams(
        do_sample=typed_field(params, "do_sample", "boolean", False),
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        typical_p=typical_p,
        repetition_penalty=repetition_penalty,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        occurrence_penalty=occurrence_penalty,
        seed=seed,
        watermark=typed_field(params, "watermark", "boolean", False),
        min_p=min_p or None,
        logit_bias=logit_bias(params.get("logit_bias"), vocab_size),
    )


class Validator:
    """Checks requests against the loaded model and the server's limits."""

    def __init__(self, tokenizer: Any, config: Config, vocab_size: int,
                 adapter_names: Callable[[], list[str]] | None = None, model_id: str | None = None,
                 unavailable_reason: Callable[[GenerationRequest], str | None] | None = None) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.vocab_size = vocab_size
        self.grammars = GrammarCompiler(tokenizer, vocab_size, disabled=GRAMMARS_DISABLED
                                        if config.disable_grammar_support else None)
        self.adapter_names = adapter_names
        """The LoRA adapters served now (None: the server serves none)."""
        self.model_id = model_id
        """The base model's id, which as ``adapter_id`` means no adapter."""
        self.unavailable_reason = unavailable_reason
        """The engine's word on a valid request it still cannot run (``Engine.unavailable_reason``)."""

    def generate(self, inputs: str, params: dict[str, Any], stream: bool, *, add_special_tokens: bool = True,
                 max_top_n: int | None = None, grammar: Grammar | None = None,
                 input_ids: list[int] | None = None) -> GenerationRequest:
        """A GenerationRequest for the engine, or ValidationError with TGI's message. The OpenAI
        routes pass a rendered chat prompt (its special tokens already in the text), their own
        top-logprobs limit, the grammar they compiled for tools, and a prompt given as token ids
        (``input_ids``, run as they are; ``inputs`` is then their text)."""
        request = validate_generate(inputs, params, self.tokenizer, self.config, stream, self.vocab_size,
                                    self.grammars, add_special_tokens, max_top_n, grammar, input_ids)
        adapter_id = self.adapter(params.get("adapter_id"), "adapter_id")
        if adapter_id:
            request = replace(request, adapter_id=adapter_id)
        refused = self.unavailable_reason(request) if self.unavailable_reason is not None else None
        if refused:
            raise ValidationError(refused)
        return request

    def served_adapter(self, requested: Any) -> str | None:
        """``requested`` when it names an adapter served now, else None."""
        known = self.adapter_names() if self.adapter_names is not None else []
        return str(requested) if isinstance(requested, str) and requested in known else None

    def adapter(self, requested: Any, field_name: str) -> str | None:
        """The adapter a request names (None for the base model), or ValidationError listing the known ones."""
        if requested in (None, "") or requested == self.model_id:
            return None
        served = self.served_adapter(requested)
        if served is not None:
            return served
        known = self.adapter_names() if self.adapter_names is not None else []
        if self.adapter_names is None:
            raise ValidationError(
                f"`{field_name}`: this server serves no LoRA adapters (start it with --lora-adapters)")
        raise ValidationError(f"`{field_name}`: unknown adapter {requested!r}; known: "
                              f"{', '.join(known) or 'none yet (POST /adapters loads one)'}")


def token_id_prompt(ids: Any, vocab_size: int) -> list[int]:
    """A prompt given as token ids, checked: a non-empty list of integers the model has embeddings for."""
    if not isinstance(ids, list) or not ids:
        raise ValidationError("a token-id `prompt` must be a non-empty list of integers")
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int):
            raise ValidationError(f"a token-id `prompt` must hold integers only, got {token!r}")
        if not 0 <= token < vocab_size:
            raise ValidationError(f"`prompt` has token id {token}, outside the model's {vocab_size} embeddings")
    return list(ids)


def validate_generate(
    inputs: str, params: dict[str, Any], tokenizer: Any, config: Config, stream: bool, vocab_size: int,
    grammars: GrammarCompiler, add_special_tokens: bool = True, max_top_n: int | None = None,
    grammar: Grammar | None = None, input_ids: list[int] | None = None,
) -> GenerationRequest:
    assert config.max_input_tokens is not None and config.max_total_tokens is not None
    sampling = sampling_params(params, vocab_size)

    best_of = typed_field(params, "best_of", "integer")
    if best_of is not None:
        if not 0 < best_of <= config.max_best_of:
            raise ValidationError(f"`best_of` must be > 0 and <= {config.max_best_of}. Given: {best_of}")
        if best_of > 1:
            if stream:
                raise ValidationError("`best_of` != 1 is not supported when streaming tokens")
            if not uses_sampling(sampling):
                raise ValidationError("you must use sampling when `best_of` is > 1")
            if sampling.seed is not None:
                raise ValidationError("`seed` must not be set when `best_of` > 1")

    stop = params.get("stop") or []
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ValidationError("`stop` must be a list of strings")
    if len(stop) > config.max_stop_sequences:
        raise ValidationError(
            f"`stop` supports up to {config.max_stop_sequences} stop sequences. Given: {len(stop)}"
        )
    if any(s == "" for s in stop):
        raise ValidationError("`stop` sequences cannot be empty strings")
    if any(len(s) > MAX_STOP_CHARACTERS for s in stop):
        raise ValidationError(f"`stop` sequences must be at most {MAX_STOP_CHARACTERS} characters long. "
                              f"Given: {max(len(s) for s in stop)}")

    top_n_tokens = typed_field(params, "top_n_tokens", "integer") or 0
    max_top_n = config.max_top_n_tokens if max_top_n is None else max_top_n
    if not 0 <= top_n_tokens <= max_top_n:
        raise ValidationError(f"`top_n_tokens` must be >= 0 and <= {max_top_n}. Given: {top_n_tokens}")

    decoder_input_details = typed_field(params, "decoder_input_details", "boolean", False)
    if decoder_input_details and stream:
        raise ValidationError("`decoder_input_details` == true is not supported when streaming tokens")

    if grammar is None and params.get("grammar") is not None:  # a grammar the caller compiled is not compiled again
        try:
            grammar = grammar_from_parameter(grammars, params["grammar"])
        except GrammarError as error:
            message = str(error)
            raise ValidationError(message if message.startswith("`grammar") else f"`grammar`: {message}") from None
    cache_salt = params.get("cache_salt")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise ValidationError(f"`cache_salt` must be a non-empty string, got {cache_salt!r}")
    priority = params.get("priority", "normal")
    if priority not in PRIORITY_CLASSES:
        raise ValidationError(f"`priority` must be one of {', '.join(PRIORITY_CLASSES)}; got {priority!r}")
    if input_ids is not None:
        input_ids = token_id_prompt(input_ids, vocab_size)
    elif inputs == "":
        raise ValidationError("`inputs` cannot be empty")
    else:
        input_ids = list(tokenizer(inputs, add_special_tokens=add_special_tokens)["input_ids"])
    if not input_ids:
        raise ValidationError("`inputs` cannot be empty")

    truncate = typed_field(params, "truncate", "integer")
    if truncate is not None:
        if not 0 < truncate <= config.max_input_tokens:
            raise ValidationError(
                f"`truncate` must be strictly positive and less than {config.max_input_tokens}. Given: {truncate}"
            )
        input_ids = input_ids[-truncate:]
    if len(input_ids) > config.max_input_tokens:
        raise ValidationError(
            f"`inputs` must have less than {config.max_input_tokens} tokens. Given: {len(input_ids)}"
        )
    if max(input_ids) >= vocab_size:
        raise ValidationError(f"`inputs` has token id {max(input_ids)}, beyond the model's {vocab_size} embeddings")

    max_new_tokens = typed_field(params, "max_new_tokens", "integer")
    if max_new_tokens is None:
        max_new_tokens = config.max_total_tokens - len(input_ids)
    elif max_new_tokens <= 0:
        raise ValidationError("`max_new_tokens` must be strictly positive")
    if len(input_ids) + max_new_tokens > config.max_total_tokens:
        raise ValidationError(
            f"`inputs` tokens + `max_new_tokens` must be <= {config.max_total_tokens}. "
            f"Given: {len(input_ids)} `inputs` tokens and {max_new_tokens} `max_new_tokens`"
        )
    min_tokens = typed_field(params, "min_tokens", "integer", 0)
    if not 0 <= min_tokens <= max_new_tokens:
        raise ValidationError(f"`min_tokens` must be >= 0 and <= the tokens asked for (`max_new_tokens`, "
                              f"OpenAI's `max_tokens`): {max_new_tokens}. Given: {min_tokens}")

    return GenerationRequest(
        inputs=inputs,
        input_ids=input_ids,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        stop=tuple(stop),
        details=typed_field(params, "details", "boolean", False),
        decoder_input_details=decoder_input_details,
        top_n_tokens=top_n_tokens,
        return_full_text=typed_field(params, "return_full_text", "boolean", False),
        best_of=best_of or 1,
        priority=priority,
        grammar=grammar,
        # The salt keeps tenants apart: it stays out of what hooks and the request log see.
        parameters={name: value for name, value in params.items() if name != "cache_salt"},
        cache_salt=cache_salt,
        min_tokens=min_tokens,
        ignore_eos=typed_field(params, "ignore_eos", "boolean", False),
        stop_token_ids=stop_token_ids(params.get("stop_token_ids"), vocab_size),
    )
