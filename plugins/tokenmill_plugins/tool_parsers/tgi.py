"""The ``tgi`` tool-call parser: TGI's design, where the server shows the tools in a system message
and holds the output to a grammar of JSON calls, ``{"name": ..., "arguments": ...}`` one per line
(:func:`tokenmill.http.openai.chat.tool_grammar`). It is the default for a chat template that knows no
tool format, and the format every parser's ``tool_choice: "required"`` or named function uses."""

from __future__ import annotations

from collections.abc import Sequence

import tokenmill
from tokenmill.interfaces.parsers import FunctionTool, ParsedCall, ParsedOutput, ToolParser
from tokenmill.parsing.json_calls import scan_tool_calls


class TgiParser(ToolParser):
    name = "tgi"
    description = "TGI's grammar-held JSON calls, the tools in a system message (any model)"
    grammar_forced = True
    order = 1000

    def parse(self, text: str, tools: Sequence[FunctionTool], final: bool) -> ParsedOutput:
        visible = text.lstrip()
        if not visible:
            return ParsedOutput(text if final else "")
        if not visible.startswith("{"):  # the grammar's plain answer: text that does not open an object
            return ParsedOutput(text)
        calls = tuple(ParsedCall(call.name, call.arguments, call.complete) for call in scan_tool_calls(text).calls)
        if final and not calls:
            return ParsedOutput(text)
        return ParsedOutput("", calls)


@tokenmill.hookimpl
def tokenmill_tool_parsers() -> list[ToolParser]:
    return [TgiParser()]
