"""The ``llama3_json`` tool-call parser: Llama 3.1-3.3's JSON calls, ``{"name": ..., "parameters":
{...}}``, optionally after ``<|python_tag|>``, several separated by ``;``. An output that does not
open with a call is a plain answer."""

from __future__ import annotations

from collections.abc import Sequence

import tokenmill
from tokenmill.interfaces.parsers import FunctionTool, ParsedOutput, ToolParser
from tokenmill.parsing.json_prefix import json_call_run, skip_space

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    description = "{\"name\", \"parameters\"} JSON calls, ';'-separated (Llama 3.1, 3.2, 3.3)"
    order = 60
    special_texts = (PYTHON_TAG,)

    def detects(self, chat_template: str) -> bool:
        return PYTHON_TAG in chat_template or "dictionary of argument name" in chat_template

    def parse(self, text: str, tools: Sequence[FunctionTool], final: bool) -> ParsedOutput:
        start = skip_space(text, 0)
        rest = text[start:]
        if not final and (not rest or PYTHON_TAG.startswith(rest)):
            return ParsedOutput("")
        if rest.startswith(PYTHON_TAG):
            start = skip_space(text, start + len(PYTHON_TAG))
        elif not rest.startswith("{"):
            return ParsedOutput(text)
        calls = json_call_run(text, start, ";")
        if final and not calls:
            return ParsedOutput(text)
        return ParsedOutput("", tuple(calls))


@tokenmill.hookimpl
def tokenmill_tool_parsers() -> list[ToolParser]:
    return [Llama3JsonParser()]
