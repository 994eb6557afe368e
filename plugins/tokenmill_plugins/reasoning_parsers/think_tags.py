"""Reasoning between ``<think>`` and ``</think>``: the ``deepseek_r1`` and ``qwen3`` parsers.

DeepSeek-R1's template opens ``<think>`` in the prompt, so its output starts in the reasoning and
everything before ``</think>`` is reasoning (all of it when the output never closes it). Qwen3's
output is reasoning only when ``<think>`` opens it or the prompt left one open; with
``enable_thinking: false`` its template closes an empty one, and the output is all answer."""

from __future__ import annotations

import tokenmill
from tokenmill.interfaces.parsers import ReasonedOutput, ReasoningParser
from tokenmill.parsing.markers import shown

START, END = "<think>", "</think>"


def left_open(prompt: str) -> bool:
    """Whether the prompt ends inside a ``<think>`` section (its last ``<think>`` is not closed)."""
    return prompt.rfind(START) > prompt.rfind(END)


class ThinkTagParser(ReasoningParser):
    end = END
    always_reasoning = False
    """Whether an output with no ``<think>`` of its own still starts in the reasoning (DeepSeek-R1)."""

    def starts_reasoning(self, prompt: str) -> bool:
        if left_open(prompt):
            return True
        closed_empty = prompt.rstrip().endswith(END)  # thinking switched off by the template
        return self.always_reasoning and not closed_empty

    def thinks(self, prompt: str) -> bool:
        """Unless the template switched thinking off (an empty, closed section ends the prompt)."""
        return left_open(prompt) or not prompt.rstrip().endswith(END)

    def split(self, text: str, reasoning_first: bool, final: bool) -> ReasonedOutput:
        visible = text.lstrip()
        if not final and visible and START.startswith(visible) and visible != START:
            return ReasonedOutput("", "", False)  # "<thi": wait for what it becomes
        start = 0
        if visible.startswith(START):
            start, reasoning_first = len(text) - len(visible) + len(START), True
        if not reasoning_first:
            return ReasonedOutput("", text, True)
        close = text.find(END, start)
        if close < 0:
            return ReasonedOutput(shown(text[start:], (END,), final), "", False)
        return ReasonedOutput(text[start:close], text[close + len(END):].lstrip("\n"), True)


class DeepSeekR1Parser(ThinkTagParser):
    name = "deepseek_r1"
    description = "<think>...</think>, the output starting in the reasoning (DeepSeek-R1 and its distills)"
    always_reasoning = True


class Qwen3Parser(ThinkTagParser):
    name = "qwen3"
    description = "<think>...</think> when the output or the prompt opens it (Qwen3, QwQ)"


@tokenmill.hookimpl
def tokenmill_reasoning_parsers() -> list[ReasoningParser]:
    return [DeepSeekR1Parser(), Qwen3Parser()]
