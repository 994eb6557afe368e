"""Tool calls read out of a constrained output, whole or as it grows.

The tools grammar (:func:`tokenmill.http.openai.chat.tool_grammar`) makes a call output one or
more JSON objects ``{"name": "<tool>", "arguments": <value>}``, one per line. The scanner here walks
that text one character at a time and says, as soon as it knows, that a call began (its name) and
which characters of its arguments came next, so a stream can send OpenAI's incremental
``tool_calls`` deltas while the model is still writing. A whole response reads the same text with
the same scanner, so the streamed pieces add up to exactly the arguments it returns: the JSON text
as the model wrote it, not re-serialized.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(\S)')
"""The part of a call before its arguments, up to the arguments' first character."""

SCALAR_ENDS = frozenset(",}] \t\r\n")

MAX_HEAD_CHARS = 1024
"""A call's head longer than this is not a call (tool names are short): the scan stops there."""


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str
    """The arguments as JSON text, as OpenAI returns them."""

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ScannedCall:
    id: str
    name: str
    arguments: str = ""
    complete: bool = False

    def as_call(self) -> ToolCall:
        return ToolCall(self.id, self.name, self.arguments)


@dataclass(frozen=True)
class CallDelta:
    """What one piece of output added to call ``index``: its start (``name`` set, no arguments yet)
    or the next characters of its arguments."""

    index: int
    name: str | None
    arguments: str


@dataclass
class ToolCallScanner:
    """Finds the calls in an output fed to it piece by piece (see the module's docstring)."""

    calls: list[ScannedCall] = field(default_factory=list)
    state: str = "between"
    """between calls | head (before the arguments) | arguments | tail (before the closing brace) | done."""
    head: str = ""
    value_kind: str = ""
    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    @property
    def finished(self) -> bool:
        """Whether the output so far is whole calls only (nothing cut short)."""
        return bool(self.calls) and self.state in ("between", "done") and all(c.complete for c in self.calls)

    def feed(self, text: str) -> list[CallDelta]:
        """The deltas ``text`` adds: argument characters of one call within one piece come as one delta."""
        deltas: list[CallDelta] = []
        for char in text:
            self._step(char, deltas)
        return deltas

    def _step(self, char: str, deltas: list[CallDelta]) -> None:
        if self.state == "between":
            if char == "{":
                self.state, self.head = "head", char
            elif not char.isspace():
                self.state = "done"  # not a call: the grammar allows no text after the calls
        elif self.state == "head":
            self._head(char, deltas)
        elif self.state == "arguments":
            self._argument(char, deltas)
        elif self.state == "tail":
            if char == "}":
                self.calls[-1].complete = True
                self.state = "between"
            elif not char.isspace():
                self.state = "done"

    def _head(self, char: str, deltas: list[CallDelta]) -> None:
        self.head += char
        if len(self.head) > MAX_HEAD_CHARS:
            self.state = "done"
            return
        if char.isspace():
            return
        match = CALL_HEAD.fullmatch(self.head)
        if match is None:
            return
        try:
            name = json.loads(match.group(1))
        except ValueError:
            self.state = "done"
            return
        self.calls.append(ScannedCall(new_call_id(), name))
        deltas.append(CallDelta(len(self.calls) - 1, name, ""))
        self.state, self.head = "arguments", ""
        first = match.group(2)
        self.value_kind = "container" if first in "{[" else "string" if first == '"' else "scalar"
        self.depth, self.in_string, self.escaped = (1 if first in "{[" else 0), first == '"', False
        self._append(first, deltas)

    def _argument(self, char: str, deltas: list[CallDelta]) -> None:
        if self.in_string:
            self._append(char, deltas)
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
                if self.value_kind == "string":
                    self.state = "tail"
            return
        if self.value_kind == "scalar":
            if char in SCALAR_ENDS:
                self.state = "tail"
                self._step(char, deltas)
            else:
                self._append(char, deltas)
            return
        self._append(char, deltas)
        if char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
            if self.depth == 0:
                self.state = "tail"

    def _append(self, char: str, deltas: list[CallDelta]) -> None:
        index = len(self.calls) - 1
        self.calls[index].arguments += char
        last = deltas[-1] if deltas else None
        if last is not None and last.index == index and last.name is None:
            deltas[-1] = CallDelta(index, None, last.arguments + char)
        else:
            deltas.append(CallDelta(index, None, char))


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The calls in a constrained output, in order (empty when the model answered in text or was
    cut short before naming a tool). A call cut short keeps the arguments written so far, as
    OpenAI returns them with ``finish_reason: "length"``."""
    return [call.as_call() for call in scan_tool_calls(text).calls]


def scan_tool_calls(text: str) -> ToolCallScanner:
    """A scanner that has read all of ``text``: its calls, and whether they are whole."""
    scanner = ToolCallScanner()
    scanner.feed(text)
    return scanner
