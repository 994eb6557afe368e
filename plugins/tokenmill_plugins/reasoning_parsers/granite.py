"""The ``granite`` reasoning parser: Granite 3.2's thinking mode, which writes "Here is my thought
process:" then its reasoning, then "Here is my response:" then the answer. An output that does not
open with the first phrase is all answer."""

from __future__ import annotations

import tokenmill
from tokenmill.interfaces.parsers import ReasonedOutput, ReasoningParser
from tokenmill.parsing.markers import shown

THOUGHT, RESPONSE = "Here is my thought process:", "Here is my response:"


class GraniteParser(ReasoningParser):
    name = "granite"
    description = "'Here is my thought process:' ... 'Here is my response:' (Granite 3.2)"
    end = RESPONSE

    def split(self, text: str, reasoning_first: bool, final: bool) -> ReasonedOutput:
        visible = text.lstrip()
        if not final and THOUGHT.startswith(visible) and visible != THOUGHT:
            return ReasonedOutput("", "", False)
        if not visible.startswith(THOUGHT):
            return ReasonedOutput("", text, True)
        start = len(text) - len(visible) + len(THOUGHT)
        close = text.find(RESPONSE, start)
        if close < 0:
            return ReasonedOutput(shown(text[start:], (RESPONSE,), final).strip(), "", False)
        return ReasonedOutput(text[start:close].strip(), text[close + len(RESPONSE):].lstrip(), True)


@tokenmill.hookimpl
def tokenmill_reasoning_parsers() -> list[ReasoningParser]:
    return [GraniteParser()]
