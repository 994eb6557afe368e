"""What an OpenAI request says its output must follow, compiled once: OpenAI's ``response_format``
(and TGI's grammar in its place), vLLM's ``structured_outputs`` and its older ``guided_*`` fields.
A request gives at most one of them; a form this server cannot apply is a 422 naming it, never
ignored. JSON is compiled without free whitespace (:data:`tokenmill.sampling.grammar.JSON_LAYOUT`),
so a small model cannot fill its tokens with spaces."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill.http.openai.schemas import GUIDED_FIELDS, ChatRequest, SamplingFields, StructuredOutputs
from tokenmill.http.schemas import ValidationError
from tokenmill.sampling.grammar import Grammar, GrammarCompiler, GrammarError, grammar_from_parameter

IGNORED_GUIDED_FIELDS = ("guided_decoding_backend",)
"""vLLM's choice among its grammar engines: this server has one (llguidance), whatever is named."""


@dataclass(frozen=True)
class Constraint:
    """An output constraint: where the request gave it, TGI's ``grammar`` parameter that states it
    (what hooks see; None for a Lark grammar, which TGI's parameter cannot state), and the grammar."""

    field: str
    parameter: dict[str, Any] | None
    grammar: Grammar


def output_constraint(grammars: GrammarCompiler, request: SamplingFields) -> Constraint | None:
    """The one constraint a request gives (None: its output is free text)."""
    given = _given(request)
    if len(given) > 1:
        raise ValidationError(f"only one output constraint per request; got {', '.join(f'`{f}`' for f, _, _ in given)}")
    if not given:
        return None
    field, kind, value = given[0]
    try:
        return _compiled(grammars, field, kind, value)
    except GrammarError as error:
        message = str(error).replace("`grammar", f"`{field}", 1)
        raise ValidationError(message if message.startswith("`") else f"`{field}`: {message}") from None


def _given(request: SamplingFields) -> list[tuple[str, str, Any]]:
    """(field, kind, value) of each constraint the request sets."""
    given: list[tuple[str, str, Any]] = []
    response_format = request.response_format if isinstance(request, ChatRequest) else None
    if response_format is not None and response_format.get("type") != "text":
        given.append(("response_format", "response_format", response_format))
    outputs = request.structured_outputs
    if outputs is not None:
        unknown = sorted(outputs.model_extra or {})
        if unknown:
            raise ValidationError(f"`structured_outputs.{unknown[0]}` is not supported here; this server applies "
                                  f"{', '.join(StructuredOutputs.KINDS)}")
        values = {kind: getattr(outputs, "json_" if kind == "json" else kind) for kind in StructuredOutputs.KINDS}
        given += [(f"structured_outputs.{kind}", kind, value) for kind, value in values.items()
                  if value not in (None, False)]
    extra = request.model_extra or {}
    unknown = sorted(name for name in extra if name.startswith("guided_") and name not in IGNORED_GUIDED_FIELDS)
    if unknown:
        raise ValidationError(f"`{unknown[0]}` is not supported here; this server applies "
                              f"{', '.join(GUIDED_FIELDS)} (or `structured_outputs`)")
    given += [(name, name.removeprefix("guided_"), getattr(request, name)) for name in GUIDED_FIELDS
              if getattr(request, name) is not None]
    return given


def _compiled(grammars: GrammarCompiler, field: str, kind: str, value: Any) -> Constraint:
    if kind == "response_format":
        return response_format_constraint(grammars, value)
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else value
        return Constraint(field, {"type": "json", "value": schema}, grammars.json_schema(schema))
    if kind == "regex":
        return Constraint(field, {"type": "regex", "value": value}, grammars.regex(value))
    if kind == "choice":
        pattern = "|".join(f"(?:{regex_literal(choice)})" for choice in value)
        return Constraint(field, {"type": "regex", "value": pattern}, grammars.regex(pattern))
    return Constraint(field, None, grammars.lark(value))  # vLLM's `grammar`, in llguidance's Lark dialect


REGEX_SPECIALS = frozenset("\\.+*?()|[]{}^$#&-~")


def regex_literal(text: str) -> str:
    """``text`` as a regular expression that matches exactly it (the metacharacters escaped)."""
    return "".join("\\" + c if c in REGEX_SPECIALS else c for c in text)


def response_format_constraint(grammars: GrammarCompiler, response_format: dict[str, Any]) -> Constraint:
    """OpenAI's formats, and TGI's own (its ``grammar`` parameter, ``{"type": "json" | "regex" |
    "json_schema", "value": ...}``, as its spec documents ``response_format`` and huggingface_hub
    sends it)."""
    if "type" not in response_format:
        raise ValidationError("`response_format` must have a `type`")
    kind = response_format["type"]
    named = response_format.get("json_schema", response_format.get("value")) if kind == "json_schema" else None
    if isinstance(named, dict) and named.get("name") is not None and not isinstance(named["name"], str):
        raise ValidationError("`response_format`: the schema's `name` must be a string")
    if kind in ("json", "regex") or (kind == "json_schema" and "json_schema" not in response_format):
        return Constraint("response_format", response_format, grammar_from_parameter(grammars, response_format))
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ValidationError("`response_format.json_schema` must be an object with `name` and `schema`")
        schema = spec["schema"]
    else:
        raise ValidationError(f'`response_format.type` must be "text", "json_object" or "json_schema" (or TGI\'s '
                              f'"json" or "regex"), got {kind!r}')
    try:
        return Constraint("response_format", {"type": "json", "value": schema}, grammars.json_schema(schema))
    except GrammarError as error:
        raise ValidationError(f"`response_format.json_schema.schema`: {error}") from None

