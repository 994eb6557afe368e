"""Reading JSON request bodies and the error every route answers with."""

from __future__ import annotations

import json
from typing import Any

import falcon.asgi


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
        return json.loads(raw or b"null", parse_constant=_reject_constant)
    except ValueError as error:
        raise ApiError(422, f"the request body is not valid JSON: {error}", "validation") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")
