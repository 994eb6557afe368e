"""Reading JSON request bodies and the error every route answers with."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Collection
from typing import Any

import falcon.asgi

from tokenmill.config import Config

MAX_JSON_DEPTH = 64
"""The deepest a request body may nest lists and objects (a JSON schema or a tool's parameters need far fewer)."""


class ApiError(Exception):
    """An error answered with TGI's ``{"error", "error_type"}`` body."""

    def __init__(self, status: int, message: str, error_type: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type

    def body(self) -> dict[str, str]:
        return {"error": self.message, "error_type": self.error_type}


MIN_VALUE_LIMIT = 65_536
PARSED_OFF_LOOP_BYTES = 64_000
"""Bodies at least this large are parsed and checked on a thread, one at a time: a 2 MB body takes about
a second, which on the event loop would stall every stream and the readiness probe."""


async def read_json(req: falcon.asgi.Request, config: Config) -> Any:
    """The request's JSON body, checked: at most ``--payload-limit`` bytes, read within
    ``--body-read-timeout`` seconds (408 after it), holding at most :func:`value_limit` values. Read
    once (a route that dispatches on the body, as SageMaker's /invocations does, leaves it in
    ``req.context`` for the route it hands over to)."""
    if "json_body" in req.context:
        return req.context["json_body"]
    body = await _read_json(req, config.payload_limit, config.body_read_timeout, value_limit(config))
    req.context["json_body"] = body
    return body


def is_json_media(content_type: str | None) -> bool:
    """Whether a ``Content-Type`` says JSON (``application/json``, or ``application/<x>+json``), as TGI's
    routes require: a browser's cross-site "simple" request can send only text and form types."""
    media = (content_type or "").split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def value_limit(config: Config) -> int:
    """The most values (list items and object members) a body may hold: room for the most prompts a
    request may give (``--max-client-batch-size``) as token ids up to ``--max-input-tokens``, and never
    fewer than :data:`MIN_VALUE_LIMIT`. Checked before the body's shape is read: reading a 2 MB list of
    lists holds the interpreter for seconds, whatever thread it runs on."""
    prompts = config.max_client_batch_size * (config.max_input_tokens or 0)
    return max(MIN_VALUE_LIMIT, prompts + MIN_VALUE_LIMIT // 16)


async def _read_json(req: falcon.asgi.Request, limit: int, timeout: float | None, max_values: int) -> Any:
    if req.content_type is not None and not is_json_media(req.content_type):
        raise_not_json()
    if req.content_length is not None and req.content_length > limit:
        raise ApiError(413, f"the request body is larger than the payload limit of {limit} bytes", "validation")
    try:
        raw = await asyncio.wait_for(req.stream.read(limit + 1), timeout)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s (--body-read-timeout)",
                       "validation") from None
    if len(raw) > limit:
        raise ApiError(413, f"the request body is larger than the payload limit of {limit} bytes", "validation")
    if raw and req.content_type is None:
        raise_not_json()  # an empty body without a type reads as null: "must be a JSON object", as before
    if len(raw) >= PARSED_OFF_LOOP_BYTES:
        return await asyncio.to_thread(parse_large_json, raw, max_values)
    return parse_json(raw, max_values)


def raise_not_json() -> None:
    raise ApiError(415, "the request body must be JSON, sent with the header `Content-Type: application/json`",
                   "validation")


_STRING = re.compile(rb'"(?:[^"\\]+|\\.)*"')


def values_in(raw: bytes) -> int:
    """At least as many as the list items and object members of a JSON text, counted on its bytes (its
    separators and openings outside strings) in milliseconds, before ``json.loads`` holds the interpreter."""
    bare = _STRING.sub(b'""', raw)
    return bare.count(b",") + bare.count(b"[") + bare.count(b"{")


_parsing_large = threading.Lock()


def parse_large_json(raw: bytes, max_values: int) -> Any:
    """:func:`parse_json` for a large body, one at a time: ``json.loads`` holds the interpreter until it
    returns, so several at once would keep the event loop waiting for each in turn."""
    with _parsing_large:
        return parse_json(raw, max_values)


def parse_json(raw: bytes, max_values: int | None = None) -> Any:
    """A body's JSON, checked (:func:`body_problem`) and, before it is parsed, counted: at most
    ``max_values`` list items and object members; an ApiError (422) says what is wrong."""
    if max_values is not None and values_in(raw) > max_values:
        raise ApiError(422, f"the request body holds more than {max_values} values (list items and object "
                            "members, all told)", "validation")
    try:
        body = json.loads(raw or b"null", parse_constant=_reject_constant)
    except RecursionError:
        raise ApiError(422, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", "validation") from None
    except ValueError as error:
        raise ApiError(422, f"the request body is not valid JSON: {error}", "validation") from None
    problem = body_problem(body)
    if problem:
        raise ApiError(422, f"the request body {problem}", "validation")
    return body


def body_problem(value: Any) -> str | None:
    """What makes a parsed body unusable although it is JSON: nesting deeper than :data:`MAX_JSON_DEPTH`,
    or a lone UTF-16 surrogate (``"\\ud800"``), which is no Unicode text. Walked without recursion: the
    check must not be what overflows."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if not _is_unicode(item):
                return "has a lone UTF-16 surrogate escape (not valid Unicode text)"
            continue
        if isinstance(item, dict):
            item = [*item.keys(), *item.values()]
        if isinstance(item, list):
            if depth + 1 > MAX_JSON_DEPTH:
                return f"nests deeper than {MAX_JSON_DEPTH} levels"
            stack.extend((child, depth + 1) for child in item if isinstance(child, (str, dict, list)))
    return None


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def cross_site_refusal(req: falcon.asgi.Request, trusted: Collection[str] = ()) -> str | None:
    """Why a request that changes the server's state looks sent by a web page of another site than this
    server or the ``trusted`` origins, or None: browsers say so in ``Sec-Fetch-Site`` and name the page's
    origin in ``Origin``; clients outside a browser send neither."""
    origin = req.get_header("Origin")
    if origin is not None and origin.rstrip("/") in trusted:
        return None
    if (req.get_header("Sec-Fetch-Site") or "").lower() == "cross-site":
        return "it comes from a web page of another site"
    host = req.get_header("Host") or ""
    if origin is not None and origin.split("://", 1)[-1].rstrip("/").lower() != host.lower():
        return f"its Origin ({origin}) is neither this server ({host}) nor one --cors-allow-origin names"
    return None
