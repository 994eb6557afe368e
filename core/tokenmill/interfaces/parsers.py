"""The contracts of output parsers: tool-call parsers (``--tool-call-parser``) and reasoning parsers
(``--reasoning-parser``).

A parser reads the model's output text as it grows. It is called with the whole output so far and
returns what that text holds, never consuming anything: the server calls it again with a longer
text after every token, and sends what grew since the last call (content, reasoning, a new call,
more of a call's arguments). So what a parser returns for a text must only grow as the text
grows: it holds back a tail that may still become a marker (``<tool_`` before ``<tool_call>``),
and writes a call's arguments only as far as they can no longer change. With ``final`` set the
text is whole, and nothing is held back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenmill.interfaces.base import Implementation


@dataclass(frozen=True)
class FunctionTool:
    """A function the request offers the model: its name, description and JSON schema."""

    name: str
    description: str
    parameters: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        """The tool as OpenAI's request writes it (what chat templates' ``tools`` read)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ParsedCall:
    """One tool call in the output: its name, and its arguments as JSON text, as far as written."""

    name: str
    arguments: str
    complete: bool
    """Whether the call ended (its arguments are whole)."""


@dataclass(frozen=True)
class ParsedOutput:
    """What an output holds: the text meant for the user and the tool calls."""

    content: str
    calls: tuple[ParsedCall, ...] = field(default_factory=tuple)


class ToolParser(Implementation):
    """Reads tool calls out of a model's output, in the format the model writes them.

    ``parse(text, tools, final)`` returns a :class:`ParsedOutput` (see the module's docstring for how
    it must grow). ``detects(chat_template)`` says whether a chat template writes this format, so that
    a server started without ``--tool-call-parser`` picks the parser its model's template asks for.
    """

    kind = "tool_parser"
    grammar_forced = False
    """True for a parser of a format the server itself holds the output to by a grammar, with its
    instructions in a system message (TGI's ``tgi``); False when the chat template shows the tools
    and the model writes calls in its own format."""
    order = 100
    """Which parser's ``detects`` is asked first (lower first): the more specific formats go first."""
    special_texts: tuple[str, ...] = ()
    """Special tokens the format uses as markers (Mistral's ``[TOOL_CALLS]``): their text stays in the
    output this parser reads, where other special tokens are left out."""

    def detects(self, chat_template: str) -> bool:
        return False

    def parse(self, text: str, tools: Sequence[FunctionTool], final: bool) -> ParsedOutput:
        raise NotImplementedError


@dataclass(frozen=True)
class ReasonedOutput:
    """An output split into the model's reasoning and the rest."""

    reasoning: str
    content: str
    ended: bool
    """Whether the reasoning section ended (what follows is the answer)."""


class ReasoningParser(Implementation):
    """Splits a reasoning model's output into its thinking and its answer.

    ``starts_reasoning(prompt)`` says whether the output begins inside the reasoning section (a
    template that opens ``<think>`` in the prompt), ``thinks(prompt)`` whether it will reason at all
    (a model that opens ``<think>`` itself); ``split(text, reasoning_first, final)`` returns a
    :class:`ReasonedOutput` that only grows as ``text`` grows. ``end`` is the text that ends the
    reasoning section, which a grammar for the answer waits for.
    """

    kind = "reasoning_parser"
    end = ""

    def starts_reasoning(self, prompt: str) -> bool:
        return False

    def thinks(self, prompt: str) -> bool:
        """Whether the output will reason before it answers: then a grammar for the answer (a
        ``response_format``, a required tool call) waits for ``end``."""
        return self.starts_reasoning(prompt)

    def split(self, text: str, reasoning_first: bool, final: bool) -> ReasonedOutput:
        raise NotImplementedError
