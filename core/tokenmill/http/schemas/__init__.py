"""What the typed shapes of requests and responses share, and :func:`check_body`, the one place a
request body becomes its model.

Each API's models (:mod:`tokenmill.http.tgi.schemas`, :mod:`tokenmill.http.openai.schemas`,
:mod:`tokenmill.http.schemas.ops`) are the only statement of a field's type and static bounds: a
wrong kind, null where TGI has no ``Option``, a missing field or a value out of its documented
range is a 422 naming the field, here. They are also the source of the OpenAPI document
(:mod:`tokenmill.http.openapi`). Routes pass the model on; the checks that need the tokenizer, the
vocabulary or the server's ``--max-*`` limits come after, in :mod:`tokenmill.http.tgi.validation`.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

import pydantic
from pydantic import BaseModel, ConfigDict

from tokenmill.http.schemas.kinds import KIND_ERROR


class ValidationError(Exception):
    """Invalid input: answered with 422 and ``error_type`` ``validation``."""


class RequestModel(BaseModel):
    """A request body or a part of one: unknown fields are kept, as TGI's serde ignores them."""

    model_config = ConfigDict(extra="allow")
    errors_named_within: ClassVar[tuple[str, ...]] = ()
    """Fields under these are named alone in error messages (``temperature``, not ``parameters.temperature``)."""


class ResponseModel(BaseModel):
    """A response body, documented (the routes write them as dicts; tests check them against these)."""


Body = TypeVar("Body", bound=RequestModel)

_KIND_OF_ERROR = {"model_type": "an object", "model_attributes_type": "an object", "dict_type": "an object",
                  "list_type": "a list"}
"""Pydantic's own type errors (nested models, lists), said in :mod:`~tokenmill.http.schemas.kinds`' words."""


def check_body(model: type[Body], body: Any) -> Body:
    """``body`` (parsed JSON) read as ``model``, or ValidationError with the first problem, worded
    as TGI's and tokenmill's other validation messages are."""
    if not isinstance(body, dict):
        raise ValidationError(f"the request body must be a JSON object, got {shown(body)}")
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as error:
        raise ValidationError(describe(error.errors()[0], model.errors_named_within)) from None


def field_path(location: tuple[str | int, ...], named_within: tuple[str, ...] = ()) -> str:
    """``("messages", 0, "name")`` as ``messages[0].name``; a field under one of ``named_within``
    (TGI's ``parameters``) by its own name, as TGI's messages name parameters."""
    if len(location) > 1 and location[0] in named_within:
        location = location[1:]
    path = ""
    for part in location:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def shown(value: Any) -> str:
    """A value as an error message quotes it: JSON's null, true and false, else Python's repr, cut short."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def describe(error: Any, named_within: tuple[str, ...] = ()) -> str:
    """One pydantic error as a sentence that names the field."""
    kind, value, context = error["type"], error.get("input"), error.get("ctx") or {}
    path = field_path(tuple(error["loc"]), named_within) + (f".{context['at']}" if context.get("at") else "")
    if context.get("at"):
        value = value.get(context["at"].split(".")[0]) if isinstance(value, dict) else value
    if kind == "missing":
        return f"missing field `{path}`"
    if kind in ("too_short", "too_long"):
        bound = "at least" if kind == "too_short" else "at most"
        limit = context.get("min_length" if kind == "too_short" else "max_length")
        return f"`{path}` must hold {bound} {limit} item(s), got {context.get('actual_length')}"
    expected = context.get("expected") if kind == KIND_ERROR else _KIND_OF_ERROR.get(kind)
    if kind == "literal_error":
        expected = f"one of {context.get('expected')}"
    if expected is None:
        return f"`{path}`: {error['msg']}"
    if value is None:
        return f"`{path}` must be {expected}, not null"
    return f"`{path}` must be {expected}, got {context.get('detail') or shown(value)}"
