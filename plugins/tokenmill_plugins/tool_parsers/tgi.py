"""The ``tgi`` tool-call parser: TGI's design, where the server shows the tools in a system message
and holds the output to a grammar of JSON calls, ``{"name": ..., "arguments": ...}`` one per line
(:func:`tokenmill.http.openai.chat.tool_grammar`). It is the default for a chat template that knows no
tool format, and the format every parser's ``tool_choice: "required"`` or named function uses. An
output that does not open with ``{`` is the grammar's plain answer."""

from __future__ import annotations

from collections.abc import Sequence

import tokenmill
from tokenmill.interfaces.parsers import FunctionTool, ParsedOutput, ToolParser
from tokenmill.parsing.json_prefix import json_call_run, skip_space


class TgiParser(ToolParser):
    name = "tgi"
    description = "TGI's grammar-held JSON calls, the tools in a system message (any model)"
    grammar_forced = True
    order = 1000

    def parse(self, text: str, tools: Sequence[FunctionTool], final: bool) -> ParsedOutput:
        at = skip_space(text, 0)
        if at == len(text):
            return ParsedOutput(text if final else "")
        if text[at] != "{":
            return ParsedOutput(text)
        calls = json_call_run(text, at)
        if final and not calls:
            return ParsedOutput(text)
        return ParsedOutput("", tuple(calls))


@tokenmill.hookimpl
def tokenmill_tool_parsers() -> list[ToolParser]:
    return [TgiParser()]
