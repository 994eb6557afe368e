"""What a checked request shape still needs checking against this server: its prompt and the ``--max-*``
limits, token ids against the vocabulary, its grammar compiled, its adapter served. Types and static
bounds were checked once, by its model (:mod:`tokenmill.http.tgi.schemas`). Each failure is a 422."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import fields

from tokenmill.config import Config
from tokenmill.engine.sequence import GenerationRequest, SamplingParams
from tokenmill.http.images import image_prompt
from tokenmill.http.schemas import ValidationError
from tokenmill.http.tgi.schemas import GenerateParameters
from tokenmill.model.vision import Vision
from tokenmill.sampling.grammar import Grammar, GrammarCompiler, GrammarError, grammar_from_parameter
from tokenmill.sampling.sampler import uses_sampling


def token_id_prompt(ids: Sequence[int], vocab_size: int, field: str = "prompt") -> list[int]:
    """A prompt given as token ids (their kind checked by the schema): not empty, each one the model has."""
    if not ids:
        raise ValidationError(f"a token-id `{field}` must be a non-empty list of integers")
    beyond = next((token for token in ids if token >= vocab_size), None)
    if beyond is not None:
        raise ValidationError(f"`{field}` has token id {beyond}, outside the model's {vocab_size} embeddings")
    return list(ids)


def sampling_params(params: GenerateParameters, vocab_size: int) -> SamplingParams:
    """The engine's sampling parameters; ``logit_bias`` keys are checked against the vocabulary, and a
    token named twice ("5" and "05") keeps its last bias."""
    biases: dict[int, float] = {}
    for key, bias in (params.logit_bias or {}).items():
        if not re.fullmatch("[0-9]{1,12}", key) or int(key) >= vocab_size:
            raise ValidationError(f"`logit_bias` keys must be token ids below {vocab_size}, got {key!r}")
        biases[int(key)] = bias
    same = {field.name: getattr(params, field.name) for field in fields(SamplingParams)
            if field.name not in ("min_p", "logit_bias")}  # each of the others has TGI's name and meaning
    return SamplingParams(**same, min_p=params.min_p or None, logit_bias=tuple(sorted(biases.items())))


class Validator:
    """Checks requests against the loaded model and the server's limits."""

    def __init__(self, tokenizer: object, config: Config, vocab_size: int,
                 adapter_names: Callable[[], list[str]] | None = None, model_id: str | None = None,
                 unavailable_reason: Callable[[GenerationRequest], str | None] | None = None,
                 vision: Vision | None = None) -> None:
        assert config.max_input_tokens is not None and config.max_total_tokens is not None
        self.tokenizer = tokenizer
        self.config = config
        self.vocab_size = vocab_size
        self.grammars = GrammarCompiler(tokenizer, vocab_size, disabled=config.disable_grammar_support)
        self.adapter_names = adapter_names  # the LoRA adapters served now (None: the server serves none)
        self.model_id = model_id  # the base model's id, which as ``adapter_id`` means no adapter
        self.unavailable_reason = unavailable_reason  # the engine's word on a valid request it cannot run
        self.vision = vision  # a vision-language model's processor (None: the model takes no images)

    def generate(self, inputs: str, params: GenerateParameters, stream: bool, *, add_special_tokens: bool = True,
                 max_top_n: int | None = None, grammar: Grammar | None = None,
                 input_ids: list[int] | None = None, tenant: str | None = None,
                 image_urls: Sequence[str] = ()) -> GenerationRequest:
        """A GenerationRequest for the engine, or ValidationError with TGI's message. The OpenAI routes pass
        a rendered chat prompt (special tokens in its text), their top-logprobs limit, the grammar they
        compiled, and a prompt given as token ids (``input_ids``; ``inputs`` is then their text). ``tenant``:
        who sent it (its prefix-cache part, without a ``cache_salt``). ``image_urls``: the images it names."""
        config, sampling = self.config, sampling_params(params, self.vocab_size)
        max_top_n = config.max_top_n_tokens if max_top_n is None else max_top_n
        self._check_limits(params, sampling, stream, max_top_n)
        if grammar is None and params.grammar is not None:  # a grammar the caller compiled is not compiled again
            try:
                grammar = grammar_from_parameter(self.grammars, params.grammar)
            except GrammarError as error:
                message = str(error) if str(error).startswith("`grammar") else f"`grammar`: {error}"
                raise ValidationError(message) from None
        input_ids, images = (image_prompt(self.vision, config, inputs, image_urls, add_special_tokens, params.truncate)
                             if image_urls else (input_ids, None))
        input_ids = self._prompt(inputs, input_ids, add_special_tokens, params.truncate)
        max_new_tokens = params.max_new_tokens or config.max_total_tokens - len(input_ids)
        if len(input_ids) + max_new_tokens > config.max_total_tokens:
            raise ValidationError(
                f"`inputs` tokens + `max_new_tokens` must be <= {config.max_total_tokens}. "
                f"Given: {len(input_ids)} `inputs` tokens and {max_new_tokens} `max_new_tokens`")
        if (params.min_tokens or 0) > max_new_tokens:
            raise ValidationError(f"`min_tokens` must be >= 0 and <= the tokens asked for (`max_new_tokens`, "
                                  f"OpenAI's `max_tokens`): {max_new_tokens}. Given: {params.min_tokens}")
        stop_ids = token_id_prompt(params.stop_token_ids, self.vocab_size, "stop_token_ids") \
            if params.stop_token_ids else []
        request = GenerationRequest(
            inputs=inputs, input_ids=input_ids, max_new_tokens=max_new_tokens, sampling=sampling,
            stop=tuple(params.stop), details=params.details, decoder_input_details=params.decoder_input_details,
            top_n_tokens=params.top_n_tokens or 0, return_full_text=bool(params.return_full_text),
            best_of=params.best_of or 1, priority=params.priority, grammar=grammar, min_tokens=params.min_tokens or 0,
            # The salt keeps tenants apart: it stays out of what hooks and the request log see.
            parameters=params.model_dump(exclude_unset=True, exclude={"cache_salt"}), cache_salt=params.cache_salt,
            ignore_eos=params.ignore_eos, adapter_id=self.adapter(params.adapter_id, "adapter_id"), tenant=tenant,
            stop_token_ids=tuple(dict.fromkeys(stop_ids)), images=images)
        refused = self.unavailable_reason(request) if self.unavailable_reason is not None else None
        if refused:
            raise ValidationError(refused)
        return request

    def _check_limits(self, params: GenerateParameters, sampling: SamplingParams, stream: bool,
                      max_top_n: int) -> None:
        config, best_of, top_n = self.config, params.best_of or 1, params.top_n_tokens or 0
        refusals = (
            (best_of > config.max_best_of, f"`best_of` must be > 0 and <= {config.max_best_of}. Given: {best_of}"),
            (best_of > 1 and stream, "`best_of` != 1 is not supported when streaming tokens"),
            (best_of > 1 and not uses_sampling(sampling), "you must use sampling when `best_of` is > 1"),
            (best_of > 1 and sampling.seed is not None, "`seed` must not be set when `best_of` > 1"),
            (len(params.stop) > config.max_stop_sequences,
             f"`stop` supports up to {config.max_stop_sequences} stop sequences. Given: {len(params.stop)}"),
            (top_n > max_top_n, f"`top_n_tokens` must be >= 0 and <= {max_top_n}. Given: {top_n}"),
            (params.decoder_input_details and stream,
             "`decoder_input_details` == true is not supported when streaming tokens"))
        refused = next((message for failed, message in refusals if failed), None)
        if refused:
            raise ValidationError(refused)

    def _prompt(self, inputs: str, input_ids: list[int] | None, add_special_tokens: bool,
                truncate: int | None) -> list[int]:
        """The prompt's token ids (tokenized unless given), truncated, within ``--max-input-tokens``."""
        max_input = self.config.max_input_tokens
        if input_ids is None:  # (a prompt given as token ids was checked by the route that took it)
            input_ids = list(self.tokenizer(inputs, add_special_tokens=add_special_tokens)["input_ids"])
            if inputs == "" or not input_ids:
                raise ValidationError("`inputs` cannot be empty")
            token_id_prompt(input_ids, self.vocab_size, "inputs")
        if truncate is not None:
            if truncate > max_input:
                raise ValidationError(f"`truncate` must be strictly positive and less than {max_input}. "
                                      f"Given: {truncate}")
            input_ids = input_ids[-truncate:]
        if len(input_ids) > max_input:
            raise ValidationError(f"`inputs` must have less than {max_input} tokens. Given: {len(input_ids)}")
        return input_ids

    def served_adapter(self, requested: object) -> str | None:
        """``requested`` when it names an adapter served now, else None."""
        known = self.adapter_names() if self.adapter_names is not None else []
        return str(requested) if isinstance(requested, str) and requested in known else None

    def adapter(self, requested: str | None, field_name: str) -> str | None:
        """The adapter a request names (None for the base model), or ValidationError listing the known ones."""
        if requested in (None, "") or requested == self.model_id:
            return None
        if (served := self.served_adapter(requested)) is not None:
            return served
        if self.adapter_names is None:
            raise ValidationError(
                f"`{field_name}`: this server serves no LoRA adapters (start it with --lora-adapters)")
        raise ValidationError(f"`{field_name}`: unknown adapter {requested!r}; known: "
                              f"{', '.join(self.adapter_names()) or 'none yet (POST /adapters loads one)'}")
