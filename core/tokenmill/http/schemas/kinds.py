"""JSON's kinds of value as pydantic field types that convert nothing by surprise.

Pydantic's lax mode reads ``"1.5"`` as a number and ``1`` as true; TGI's serde refuses both, and so
must tokenmill. Each type here accepts exactly one JSON kind (an integer also from an integral
number such as ``2.0``, which JSON Schema counts as an integer) and fails with one error type,
:data:`KIND_ERROR`, whose ``expected`` says in words what the field wants; the error messages of
:func:`tokenmill.http.schemas.check_body` are written from it. Numbers and integers also check the
bounds they document (JSON Schema's ``minimum``, ``exclusiveMaximum``, ...), in TGI's words.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import PlainValidator, ValidationError, WithJsonSchema, WrapValidator
from pydantic_core import PydanticCustomError

KIND_ERROR = "json_kind"
"""The pydantic error type of a value of the wrong kind; its context holds ``expected``."""


def kind_error(expected: str, detail: str = "", at: str = "") -> PydanticCustomError:
    """A value that is not ``expected``; ``detail`` says what it is instead (else it is quoted), ``at``
    names the member of the value that is wrong (``type`` of a grammar)."""
    return PydanticCustomError(KIND_ERROR, "must be {expected}", {"expected": expected, "detail": detail, "at": at})


def is_number(value: Any) -> bool:
    """A JSON number that is finite (not a boolean, which Python counts as an integer)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))


def _number(value: Any) -> float:
    if not is_number(value):
        raise kind_error("a finite number")
    try:
        return float(value)
    except OverflowError:  # an integer beyond any float
        raise kind_error("a finite number", "an integer too large for one") from None


def _integer(value: Any) -> int:
    if not is_number(value) or not (isinstance(value, int) or value.is_integer()):
        raise kind_error("an integer")
    return int(value)


def _checker(expected: str, python_type: type) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if not isinstance(value, python_type):
            raise kind_error(expected)
        return value

    return check


_COMPARISONS: dict[str, tuple[str, Callable[[float, float], bool]]] = {
    "minimum": (">=", lambda value, bound: value >= bound),
    "exclusiveMinimum": (">", lambda value, bound: value > bound),
    "maximum": ("<=", lambda value, bound: value <= bound),
    "exclusiveMaximum": ("<", lambda value, bound: value < bound),
}


def _bound_text(bound: float, as_float: bool) -> str:
    for power in (63, 64):
        if abs(bound) == 2**power:
            return f"{'-' if bound < 0 else ''}2^{power}"
    return str(float(bound)) if as_float else str(bound)


def bounds_rule(bounds: dict[str, float], as_float: bool) -> str:
    """JSON Schema's bounds in TGI's words: "strictly positive", or "> 0.0 and < 1.0"."""
    if bounds == {"exclusiveMinimum": 0}:
        return "strictly positive"
    return " and ".join(f"{_COMPARISONS[name][0]} {_bound_text(bound, as_float)}" for name, bound in bounds.items())


def _bounded(convert: Callable[[Any], Any], bounds: dict[str, float], as_float: bool) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        converted = convert(value)
        compared = value if isinstance(value, int) else converted  # an integer beyond floats compares exactly
        if not all(_COMPARISONS[name][1](compared, bound) for name, bound in bounds.items()):
            raise kind_error(bounds_rule(bounds, as_float))
        return converted

    return check


def number(**bounds: float) -> Any:
    """A finite number within JSON Schema's ``bounds`` (``minimum``, ``exclusiveMinimum``, ``maximum``,
    ``exclusiveMaximum``): checked, and documented."""
    return Annotated[float, PlainValidator(_bounded(_number, bounds, True)),
                     WithJsonSchema({"type": "number", **bounds})]


def integer(**bounds: int) -> Any:
    """An integer (``2.0`` too) within ``bounds``, as :func:`number`'s."""
    return Annotated[int, PlainValidator(_bounded(_integer, bounds, False)),
                     WithJsonSchema({"type": "integer", **bounds})]


def string(*, enum: list[str] | tuple[str, ...] | None = None, min_length: int = 0,
           max_length: int | None = None) -> Any:
    """A string; one of ``enum`` when given, ``min_length`` to ``max_length`` characters long."""
    schema: dict[str, Any] = {"type": "string"}
    expected = "a string"
    if enum is not None:
        schema["enum"], expected = list(enum), f"one of {', '.join(enum)}"
    if min_length:
        schema["minLength"], expected = min_length, f"a string of at least {min_length} character(s)"
    if max_length is not None:
        schema["maxLength"] = max_length
        expected = (f"a string of {min_length} to {max_length} characters" if min_length
                    else f"a string of at most {max_length} characters")

    def check(value: Any) -> str:
        if not isinstance(value, str) or (enum is not None and value not in enum):
            raise kind_error(expected)
        if len(value) < min_length or (max_length is not None and len(value) > max_length):
            raise kind_error(expected, detail=f"{len(value)} characters" if value else "an empty string")
        return value

    return Annotated[str, PlainValidator(check), WithJsonSchema(schema)]


Number = number()
Integer = integer()
String = string()
Boolean = Annotated[bool, PlainValidator(_checker("a boolean", bool)), WithJsonSchema({"type": "boolean"})]
Object = Annotated[dict[str, Any], PlainValidator(_checker("an object", dict)), WithJsonSchema({"type": "object"})]
"""Any JSON object, its members read by the handler (a JSON schema, a grammar, template variables)."""


def one_of(expected: str) -> WrapValidator:
    """For a union: one error that lists what the field may be, instead of one per member of the union."""

    def validate(value: Any, handler: Callable[[Any], Any]) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise kind_error(expected) from None

    return WrapValidator(validate)


def documented_as(schema: dict[str, Any]) -> WithJsonSchema:
    """The field's documentation, where validation is looser on purpose (the handler gives the
    precise message, e.g. a grammar's)."""
    return WithJsonSchema(schema)
