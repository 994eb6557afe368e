"""Reading JSON request bodies and the error every route answers with."""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

import falcon.asgi

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


async def read_json(req: falcon.asgi.Request, limit: int) -> Any:
    """The request's JSON body, checked; read once (a route that dispatches on the body, as SageMaker's
    /invocations does, leaves it in ``req.context`` for the route it hands over to)."""
    if "json_body" in req.context:
        return req.context["json_body"]
    body = await _read_json(req, limit)
    req.context["json_body"] = body
    return body


def is_json_media(content_type: str | None) -> bool:
    """Whether a ``Content-Type`` says JSON (``application/json``, or ``application/<x>+json``), as TGI's
    routes require: a browser's cross-site "simple" request can send only text and form types."""
    media = (content_type or "").split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def _read_json(req: falcon.asgi.Request, limit: int) -> Any:
    if not is_json_media(req.content_type):
        raise ApiError(415, "the request body must be JSON, sent with the header `Content-Type: application/json`",
                       "validation")
    if req.content_length is not None and req.content_length > limit:
        raise ApiError(413, f"the request body is larger than the payload limit of {limit} bytes", "validation")
    raw = await req.stream.read(limit + 1)
    if len(raw) > limit:
        raise ApiError(413, f"the request body is larger than the payload limit of {limit} bytes", "validation")
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
