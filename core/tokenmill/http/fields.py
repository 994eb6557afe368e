"""Reading typed fields out of JSON request bodies (TGI's parameters and OpenAI's fields alike):
a field of the wrong type is a validation error that names it."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

MISSING: Any = object()
"""Marks a field that is absent (where None, JSON's null, is a value of its own)."""


class ValidationError(Exception):
    """Invalid input: answered with 422 and ``error_type`` ``validation``."""


def is_number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))


def _is_integer(value: Any) -> bool:
    return is_number(value) and (isinstance(value, int) or value.is_integer())


_KINDS: dict[str, tuple[str, Callable[[Any], bool], Callable[[Any], Any]]] = {
    "number": ("a finite number", is_number, float),
    "integer": ("an integer", _is_integer, int),
    "boolean": ("a boolean", lambda v: isinstance(v, bool), bool),
    "string": ("a string", lambda v: isinstance(v, str), str),
    "object": ("an object", lambda v: isinstance(v, dict), dict),
}


def typed_field(body: dict[str, Any], name: str, kind: str, default: Any = None) -> Any:
    """``body[name]`` checked to be of ``kind`` (number, integer, boolean, string, object) and
    converted to it; ``default`` when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    described, valid, convert = _KINDS[kind]
    if not valid(value):
        raise ValidationError(f"`{name}` must be {described}, got {value!r}")
    try:
        return convert(value)
    except OverflowError:  # an integer beyond any float
        raise ValidationError(f"`{name}` must be {described}, got an integer too large for one") from None
