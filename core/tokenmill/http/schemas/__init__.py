"""The typed shapes of every request and response tokenmill serves (pydantic models), and
:func:`check_body`, the one place a request body's JSON types are checked.

The models are the source of two things: the first check of each body at a route's entry (wrong
kind, null where TGI has no ``Option``, a missing field: a 422 naming the field), and the OpenAPI
document (:mod:`tokenmill.http.openapi`). The checks that need the model or the server's limits
come after, in :mod:`tokenmill.http.validation` and :mod:`tokenmill.http.openai.parse`.
"""

from __future__ import annotations

from typing import Any, TypeVar

import pydantic

from tokenmill.http.fields import ValidationError
from tokenmill.http.schemas.kinds import KIND_ERROR
from tokenmill.http.schemas.tgi import RequestModel

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
    expected = context.get("expected") if kind == KIND_ERROR else _KIND_OF_ERROR.get(kind)
    if kind == "literal_error":
        expected = f"one of {context.get('expected')}"
    if expected is None:
        return f"`{path}`: {error['msg']}"
    if value is None:
        return f"`{path}` must be {expected}, not null"
    return f"`{path}` must be {expected}, got {context.get('detail') or shown(value)}"
