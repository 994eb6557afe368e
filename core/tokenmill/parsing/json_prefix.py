"""A JSON object read as far as it is written: each key's value as the raw text the model wrote so
far, whether that value is whole, and where the object ends. Raw text only grows as the output
grows, so a call's arguments can be streamed as they come, exactly as the model wrote them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from tokenmill.interfaces.parsers import ParsedCall

SCALAR_ENDS = frozenset(",}] \t\r\n")
WHITESPACE = " \t\r\n"


@dataclass
class ObjectPrefix:
    """An object's members so far: ``values`` maps each key to its raw value text (whole, or as far
    as written for the last one); ``end`` is the index just after the closing brace, None while
    the object is open."""

    values: dict[str, str] = field(default_factory=dict)
    whole: set[str] = field(default_factory=set)
    end: int | None = None

    def text_of(self, key: str) -> str | None:
        return self.values.get(key)

    def decoded(self, key: str) -> object:
        """A whole value, decoded (None when absent, cut short or not JSON)."""
        if key not in self.whole:
            return None
        try:
            return json.loads(self.values[key])
        except ValueError:
            return None


def skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in WHITESPACE:
        at += 1
    return at


def string_end(text: str, at: int) -> int | None:
    """The index after the JSON string opening at ``at`` (a quote), or None if it is not closed yet."""
    index = at + 1
    while index < len(text):
        char = text[index]
        if char == "\\":
            index += 2
            continue
        if char == '"':
            return index + 1
        index += 1
    return None


def value_end(text: str, at: int) -> int | None:
    """The index after the JSON value starting at ``at``, or None when the text ends first (a number
    at the very end may still grow, so it is not whole yet)."""
    first = text[at]
    if first == '"':
        return string_end(text, at)
    if first not in "{[":
        index = at
        while index < len(text) and text[index] not in SCALAR_ENDS:
            index += 1
        return index if index < len(text) else None
    depth, index = 0, at
    while index < len(text):
        char = text[index]
        if char == '"':
            closed = string_end(text, index)
            if closed is None:
                return None
            index = closed
            continue
        if char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return index + 1
        index += 1
    return None


def scan_object(text: str, start: int = 0) -> ObjectPrefix | None:
    """The object whose ``{`` is the first non-blank character from ``start``; None when ``text``
    there is not (the start of) a JSON object."""
    at = skip_space(text, start)
    if at >= len(text) or text[at] != "{":
        return None
    found = ObjectPrefix()
    at += 1
    while True:
        at = skip_space(text, at)
        if at >= len(text):
            return found
        char = text[at]
        if char == "}":
            found.end = at + 1
            return found
        if char == ",":
            at += 1
            continue
        if char != '"':
            return None
        key_end = string_end(text, at)
        if key_end is None:
            return found
        key = json.loads(text[at:key_end])
        at = skip_space(text, key_end)
        if at >= len(text):
            return found
        if text[at] != ":":
            return None
        at = skip_space(text, at + 1)
        if at >= len(text):
            return found
        end = value_end(text, at)
        if end is None:
            found.values[key] = text[at:].rstrip(WHITESPACE)
            return found
        found.values[key] = text[at:end]
        found.whole.add(key)
        at = end


def closed_value(text: str) -> str | None:
    """``text`` with the number or literal it ends in counted as whole (the output ended there)."""
    stripped = text.rstrip(WHITESPACE)
    try:
        json.loads(stripped)
    except ValueError:
        return None
    return stripped


ARGUMENT_KEYS = ("arguments", "parameters")
"""Where a JSON call keeps its arguments (llama 3 writes ``parameters``)."""


def json_call(found: ObjectPrefix) -> ParsedCall | None:
    """The call a ``{"name": ..., "arguments": ...}`` object holds, once its name is whole. Arguments
    written as a JSON string holding a JSON object or list are given decoded, once whole; any other
    value as the model wrote it."""
    name = found.decoded("name")
    if not isinstance(name, str):
        return None
    complete = found.end is not None
    key = next((key for key in ARGUMENT_KEYS if key in found.values), None)
    if key is None:
        return ParsedCall(name, "{}" if complete else "", complete)
    raw = found.values[key]
    if raw.startswith('"'):  # a string: whole before it is given, as it may hold the arguments' JSON
        inner = found.decoded(key)
        raw = (inner if holds_json(inner) else raw) if isinstance(inner, str) else ""
    return ParsedCall(name, raw, complete)


def holds_json(text: str) -> bool:
    """Whether ``text`` is a JSON object or list (arguments a model wrote as a JSON string)."""
    try:
        return isinstance(json.loads(text), (dict, list))
    except ValueError:
        return False


def json_call_run(text: str, at: int, separator: str = "", separator_required: bool = False) -> list[ParsedCall]:
    """The calls of JSON objects written one after another from ``at``, blank space between them and
    ``separator`` where given (``separator_required``: a missing one ends the run), up to the first
    object that is not a call or not whole yet."""
    calls: list[ParsedCall] = []
    while True:
        found = scan_object(text, at)
        call = json_call(found) if found is not None else None
        if call is None or found is None:
            return calls
        calls.append(call)
        if found.end is None:
            return calls
        at = skip_space(text, found.end)
        if separator and text.startswith(separator, at):
            at += len(separator)
        elif separator_required:
            return calls
