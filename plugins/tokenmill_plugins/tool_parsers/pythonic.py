"""The ``pythonic`` tool-call parser: a Python list of calls with keyword arguments,
``[get_weather(city="Paris"), get_time(zone="CET")]``, as Llama 3.2 and Llama 4 write them (Llama 4
between ``<|python_start|>`` and ``<|python_end|>``). The calls are sent once the list is whole;
an output that does not open with ``[`` is a plain answer."""

from __future__ import annotations

import ast
import json
from collections.abc import Sequence

import tokenmill
from tokenmill.interfaces.parsers import FunctionTool, ParsedCall, ParsedOutput, ToolParser
from tokenmill.parsing.markers import shown

START, END = "<|python_start|>", "<|python_end|>"


class PythonicParser(ToolParser):
    name = "pythonic"
    description = "[name(key=value, ...), ...] Python call lists (Llama 3.2, Llama 4)"
    special_texts = (START, END)

    def parse(self, text: str, tools: Sequence[FunctionTool], final: bool) -> ParsedOutput:
        code = text.strip()
        if not final and (not code or START.startswith(code)):
            return ParsedOutput("")
        code = shown(code.removeprefix(START), (END,), final).removesuffix(END).strip()
        if not code.startswith("["):
            return ParsedOutput(text)
        calls = call_list(code) if code.endswith("]") else None
        if calls is None:
            return ParsedOutput(text if final else "")
        return ParsedOutput("", calls)


def call_list(code: str) -> tuple[ParsedCall, ...] | None:
    """The calls of a whole Python list of calls with literal keyword arguments, else None."""
    try:
        tree = ast.parse(code, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        except ValueError:
            return None
        calls.append(ParsedCall(node.func.id, json.dumps(arguments), True))
    return tuple(calls)


@tokenmill.hookimpl
def tokenmill_tool_parsers() -> list[ToolParser]:
    return [PythonicParser()]
