"""Reading JSON request bodies and the error every route answers with."""

from __future__ import annotations

import json
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
    if nesting(body) > MAX_JSON_DEPTH:
        raise ApiError(422, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", "validation")
    return body


def nesting(value: Any) -> int:
    """How deep ``value`` nests lists and objects (without recursion: the check must not be what overflows)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in item if isinstance(child, (dict, list)))
    return deepest


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")
