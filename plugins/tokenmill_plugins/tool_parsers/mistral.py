"""The ``mistral`` tool-call parser: calls after ``[TOOL_CALLS]``, either a JSON list of
``{"name", "arguments"}`` objects (Mistral 7B v0.3, Mixtral, Nemo) or, from the v11 tokenizers on,
``name[ARGS]{...}`` for each call. Text before the marker is the answer's content."""

from __future__ import annotations

import re
from collections.abc import Sequence

import tokenmill
from tokenmill.interfaces.parsers import FunctionTool, ParsedCall, ParsedOutput, ToolParser
from tokenmill.parsing.json_prefix import json_call_run, skip_space, value_end
from tokenmill.parsing.markers import lead

MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"
NAMED_CALL = re.compile(r"([A-Za-z0-9_.\-]+)(?:\[ARGS\]|\[CALL_ID\][A-Za-z0-9]*\[ARGS\])?")


class MistralParser(ToolParser):
    name = "mistral"
    description = "[TOOL_CALLS] then a JSON list of calls, or name[ARGS]{...} per call (Mistral, Mixtral)"
    order = 40
    special_texts = (MARK, ARGS, "[CALL_ID]")

    def detects(self, chat_template: str) -> bool:
        return MARK in chat_template

    def parse(self, text: str, tools: Sequence[FunctionTool], final: bool) -> ParsedOutput:
        first = text.find(MARK)
        calls: list[ParsedCall] = []
        if first >= 0:
            body = skip_space(text, first + len(MARK))
            if body < len(text) and text[body] == "[":
                calls = json_call_run(text, body + 1, ",", separator_required=True)
            else:
                calls = named_calls(text, first)
        if final and not calls:
            return ParsedOutput(text)
        return ParsedOutput(lead(text, first, (MARK,), final), tuple(calls))


def named_calls(text: str, at: int) -> list[ParsedCall]:
    """``[TOOL_CALLS]name[ARGS]{...}`` calls, each after its own marker (or one after another)."""
    calls = []
    while at >= 0:
        start = skip_space(text, at + len(MARK))
        match = NAMED_CALL.match(text, start)
        if match is None or match.end() >= len(text) or text[match.end()] != "{":
            return calls
        end = value_end(text, match.end())
        arguments = text[match.end(): end if end is not None else len(text)]
        calls.append(ParsedCall(match.group(1), arguments, end is not None))
        if end is None:
            return calls
        at = text.find(MARK, end)
    return calls


@tokenmill.hookimpl
def tokenmill_tool_parsers() -> list[ToolParser]:
    return [MistralParser()]
