"""The ``hermes`` tool-call parser: each call a JSON object between ``<tool_call>`` and
``</tool_call>``, as Hermes 2 Pro/3, Qwen 2.5 and Qwen3 write them; text before the first call is
the answer's content."""

from __future__ import annotations

from collections.abc import Sequence

import tokenmill
from tokenmill.interfaces.parsers import FunctionTool, ParsedCall, ParsedOutput, ToolParser
from tokenmill.parsing.json_prefix import json_call, scan_object
from tokenmill.parsing.markers import lead

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"
    description = "<tool_call>{\"name\", \"arguments\"}</tool_call> (Hermes 2 Pro/3, Qwen 2.5, Qwen3)"
    order = 50

    def detects(self, chat_template: str) -> bool:
        return OPEN in chat_template

    def parse(self, text: str, tools: Sequence[FunctionTool], final: bool) -> ParsedOutput:
        first = text.find(OPEN)
        calls: list[ParsedCall] = []
        at = first
        while at >= 0:
            close = text.find(CLOSE, at + len(OPEN))
            found = scan_object(text[: close if close >= 0 else len(text)], at + len(OPEN))
            call = json_call(found) if found is not None else None
            if call is not None:
                calls.append(call)
            if close < 0:
                break
            at = text.find(OPEN, close + len(CLOSE))
        if final and not calls:
            return ParsedOutput(text)
        return ParsedOutput(lead(text, first, (OPEN,), final), tuple(calls))


@tokenmill.hookimpl
def tokenmill_tool_parsers() -> list[ToolParser]:
    return [HermesParser()]
