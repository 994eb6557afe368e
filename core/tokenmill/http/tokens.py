"""The tokenizer's routes: ``POST /tokenize`` in TGI's form (``inputs``) and vLLM's (``prompt`` or
``messages``), told apart by the body's keys; TGI's ``POST /chat_tokenize`` (a chat request templated
and tokenized exactly as /v1/chat/completions would run it), and vLLM's ``POST /detokenize`` and
``GET /tokenizer_info``."""

from __future__ import annotations

import json
from typing import Any

import falcon.asgi

from tokenmill.http.body import ApiError, read_json
from tokenmill.http.context import Caller
from tokenmill.http.images import image_prompt, placeholder
from tokenmill.http.openai.chat import (
    ChatError,
    message_images,
    parse_messages,
    parse_tools,
    render_prompt,
    template_kwargs,
)
from tokenmill.http.openai.convert import parse_chat
from tokenmill.http.openai.reading import ChatFormat
from tokenmill.http.openai.routes import served_model
from tokenmill.http.openai.schemas import ChatRequest
from tokenmill.http.schemas import ValidationError, check_body
from tokenmill.http.schemas.ops import DetokenizeRequest, VllmTokenizeChat, VllmTokenizePrompt
from tokenmill.http.state import ServerState, slot_held
from tokenmill.http.tgi.routes import tgi_tokenize
from tokenmill.http.tgi.validation import Validator


def serving_validator(state: ServerState) -> Validator:
    """A validator for settings only (its tokenizer is the engine's: tokenize on a worker)."""
    state.check_ready()
    validator = state.workers.first
    assert validator is not None  # set before the engine is ready
    return validator


def token_spans(validator: Validator, text: str) -> list[dict[str, Any]]:
    """TGI's tokenize response for ``text``: each token's id, text and character span. A rendered chat
    prompt already holds its special tokens, so none are added."""
    encoding = validator.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return [{"id": token_id, "text": text[start:stop], "start": start, "stop": stop}
            for token_id, (start, stop) in zip(encoding["input_ids"], encoding["offset_mapping"])]


VLLM_KEYS = ("prompt", "messages")
"""What marks a body as vLLM's ``/tokenize`` request (TGI's has ``inputs``)."""


def vllm_form(body: Any) -> bool:
    return isinstance(body, dict) and "inputs" not in body and any(key in body for key in VLLM_KEYS)


def vllm_tokenize(validator: Validator, body: dict[str, Any], chat_format: ChatFormat) -> dict[str, Any]:
    """vLLM's ``/tokenize``: a prompt's tokens, or a conversation's as the chat template renders it
    (with its tools shown as a chat request with ``tool_choice: "auto"`` shows them, and each image as the
    tokens a vision-language model gives it)."""
    tokenizer, images = validator.tokenizer, []
    if "messages" in body:
        request: VllmTokenizeChat | VllmTokenizePrompt = check_body(VllmTokenizeChat, body)
        assert isinstance(request, VllmTokenizeChat)
        try:
            tools = parse_tools(request.tools or [])
            image = placeholder(validator.vision)
            text = render_prompt(tokenizer, parse_messages(request.messages, image), tools, True,
                                 template_kwargs=template_kwargs(tokenizer, request.chat_template_kwargs),
                                 native=chat_format.native_tools,
                                 add_generation_prompt=request.add_generation_prompt,
                                 continue_final_message=request.continue_final_message, placeholder=image)
            images = message_images(request.messages)
        except ChatError as error:
            raise ValidationError(str(error)) from None
    else:
        request = check_body(VllmTokenizePrompt, body)
        assert isinstance(request, VllmTokenizePrompt)
        text = request.prompt
    ids = (image_prompt(validator.vision, validator.config, text, images, request.add_special_tokens)[0] if images
           else tokenizer.encode(text, add_special_tokens=request.add_special_tokens))
    return {"count": len(ids), "max_model_len": validator.config.max_total_tokens, "tokens": ids,
            "token_strs": tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None}


class TokenizeRoute:
    """``POST /tokenize``: TGI's body (``inputs``) gets TGI's answer, vLLM's (``prompt`` or ``messages``)
    vLLM's."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        state = self.state
        serving_validator(state)
        chat_format = state.chat_format
        assert chat_format is not None  # chosen before the engine is ready

        def tokenize(validator: Validator) -> Any:  # on a validation worker, the body's shape too
            if vllm_form(body):
                return vllm_tokenize(validator, body, chat_format)
            if not getattr(validator.tokenizer, "is_fast", False):
                raise NoFastTokenizer
            return tgi_tokenize(validator, body)

        with slot_held(state):
            body = await read_json(req, state.config)
            try:
                resp.media = await state.workers.validate(tokenize)
            except NoFastTokenizer:
                raise ApiError(404, "No fast tokenizer available", "tokenizer") from None
            except ValidationError as error:
                raise ApiError(422, str(error), "validation") from None


class NoFastTokenizer(Exception):
    """TGI's /tokenize needs a fast tokenizer's character offsets."""


class ChatTokenizeRoute:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        state = self.state
        validator = serving_validator(state)
        if not getattr(validator.tokenizer, "is_fast", False):
            raise ApiError(404, "No fast tokenizer available", "tokenizer")

        def tokenize(validator: Validator) -> dict[str, Any]:  # on a validation worker, the body's shape too
            assert state.chat_format is not None  # chosen before the engine is ready
            job = parse_chat(validator, check_body(ChatRequest, body), served_model(state), Caller(), state.chat_format)
            templated = job.requests[0].inputs
            return {"tokenize_response": token_spans(validator, templated), "templated_text": templated}

        with slot_held(state):
            body = await read_json(req, state.config)
            try:
                resp.media = await state.workers.validate(tokenize)
            except ValidationError as error:
                raise ApiError(422, str(error), "validation") from None


class DetokenizeRoute:
    """vLLM's ``{"tokens": [...]}`` → ``{"prompt": text}`` (special tokens kept, as vLLM decodes)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        state = self.state
        serving_validator(state)

        def detokenize(validator: Validator) -> str:  # on a validation worker, the body's shape too
            tokens = check_body(DetokenizeRequest, body).tokens
            beyond = [t for t in tokens if not 0 <= t < validator.vocab_size]
            if beyond:
                raise ValidationError(f"`tokens`: {beyond[0]} is not a token id of this model "
                                      f"(0 to {validator.vocab_size - 1})")
            return validator.tokenizer.decode(tokens)

        with slot_held(state):
            body = await read_json(req, state.config)
            try:
                resp.media = {"prompt": await state.workers.validate(detokenize)}
            except ValidationError as error:
                raise ApiError(422, str(error), "validation") from None


def tokenizer_config(tokenizer: Any) -> dict[str, Any]:
    """What the tokenizer was built from (its tokenizer_config.json's settings), as JSON, with its class."""
    info: dict[str, Any] = {}
    for name, value in getattr(tokenizer, "init_kwargs", {}).items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            value = str(value)
        info[name] = value
    for name in ("bos_token", "eos_token", "pad_token", "unk_token", "model_max_length", "chat_template"):
        if info.get(name) is None and getattr(tokenizer, name, None) is not None:
            info[name] = getattr(tokenizer, name)
    return {**info, "tokenizer_class": type(tokenizer).__name__}


class TokenizerInfoRoute:
    """vLLM's ``GET /tokenizer_info``: the tokenizer's configuration."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.media = tokenizer_config(serving_validator(self.state).tokenizer)
