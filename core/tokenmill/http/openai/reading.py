"""Reading a chat output with the server's parsers: its reasoning, its content and its tool calls,
whole (a response) or as it grows (a stream's deltas).

The parsers are plugins (:mod:`tokenmill.interfaces.parsers`), chosen once at start
(:func:`choose_chat_format`). Each request gets an :class:`OutputFormat`: which of them read its
output, with the tools it offered. The reasoning parser splits the text first; the tool parser
reads the answer after the reasoning.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

import pluggy

from tokenmill.interfaces.parsers import FunctionTool, ParsedCall, ReasoningParser, ToolParser
from tokenmill.plugin_manager import choose, offered

log = logging.getLogger(__name__)

FAILED_PARSERS: set[str] = set()
"""Tool parsers that raised on an output: logged with the traceback the first time, once per name."""


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


FORCED_PARSER = "tgi"
"""The parser of the grammar-held format, which ``tool_choice`` ``required`` and named functions use."""


@dataclass(frozen=True)
class ChatFormat:
    """The parsers this server reads chat outputs with."""

    tool_parser: ToolParser
    """What reads ``tool_choice: "auto"`` outputs (``--tool-call-parser``, or the template's own format)."""
    forced: ToolParser
    """What reads outputs held to the JSON-calls grammar (the ``tgi`` parser)."""
    reasoning: ReasoningParser | None = None

    @property
    def native_tools(self) -> bool:
        """Whether ``auto`` tools are shown by the chat template and written in the model's own format."""
        return not self.tool_parser.grammar_forced


def template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return "\n".join(template.values()) if isinstance(template, dict) else str(template)


def choose_chat_format(pm: pluggy.PluginManager, tool_call_parser: str | None, reasoning_parser: str | None,
                       tokenizer: Any) -> ChatFormat:
    """The parsers named by the flags; without ``--tool-call-parser``, the first parser (by ``order``)
    that recognises the chat template's tool format, else ``tgi``. An unknown name raises PluginError."""
    forced: ToolParser = choose(pm, "tool_parser", FORCED_PARSER)  # type: ignore[assignment]
    if tool_call_parser:
        parser: ToolParser = choose(pm, "tool_parser", tool_call_parser)  # type: ignore[assignment]
    else:
        template = template_text(tokenizer)
        candidates = sorted((impl for impl, _ in offered(pm, "tool_parser")), key=lambda impl: impl.order)  # type: ignore[attr-defined]
        parser = next((impl for impl in candidates if impl.unavailable_reason() is None
                       and impl.detects(template)), forced)  # type: ignore[attr-defined]
    reasoning = choose(pm, "reasoning_parser", reasoning_parser) if reasoning_parser else None
    return ChatFormat(parser, forced, reasoning)  # type: ignore[arg-type]


@dataclass(frozen=True)
class OutputFormat:
    """How one request's output is read: the tool parser (None: no tools offered) and the tools, the
    reasoning parser, and where the output starts."""

    tools: tuple[FunctionTool, ...] = ()
    tool_parser: ToolParser | None = None
    reasoning: ReasoningParser | None = None
    reasoning_first: bool = False
    parallel: bool = True
    """False: only the first call is returned (``parallel_tool_calls: false``)."""

    @property
    def reads(self) -> bool:
        return self.tool_parser is not None or self.reasoning is not None

    @property
    def special_texts(self) -> frozenset[str]:
        return frozenset(self.tool_parser.special_texts) if self.tool_parser is not None else frozenset()


@dataclass(frozen=True)
class ReadOutput:
    reasoning: str = ""
    content: str = ""
    calls: tuple[ParsedCall, ...] = ()

    @property
    def finished_calls(self) -> bool:
        """Whether the output holds calls, all of them whole (the finish reason is then ``tool_calls``)."""
        return bool(self.calls) and all(call.complete for call in self.calls)


def read_output(output: OutputFormat, text: str, final: bool) -> ReadOutput:
    """What ``text`` (the output so far, or all of it when ``final``) holds."""
    reasoning, answer = "", text
    if output.reasoning is not None:
        split = output.reasoning.split(text, output.reasoning_first, final)
        reasoning, answer = split.reasoning, (split.content if split.ended else "")
    if output.tool_parser is None or not answer:
        return ReadOutput(reasoning, answer)
    try:
        parsed = output.tool_parser.parse(answer, output.tools, final)
    except Exception:  # noqa: BLE001 - a plugin's parser that fails must not end the response: its text stays text
        name = output.tool_parser.name
        log.warning("the %s tool parser failed on an output; it is answered as text", name,
                    exc_info=name not in FAILED_PARSERS)
        FAILED_PARSERS.add(name)
        return ReadOutput(reasoning, answer)
    calls = parsed.calls if output.parallel else parsed.calls[:1]
    return ReadOutput(reasoning, parsed.content, calls)


def grown(before: str, now: str) -> str:
    """What ``now`` added to ``before`` (nothing if a parser took text back, which it must not)."""
    return now[len(before):] if now.startswith(before) else ""


@dataclass
class OutputReader:
    """One streamed choice's output, read again after every token: what grew, as OpenAI's delta fields."""

    output: OutputFormat
    text: str = ""
    sent: ReadOutput = field(default_factory=ReadOutput)
    ids: list[str] = field(default_factory=list)

    def push(self, text: str, final: bool) -> list[dict[str, Any]]:
        """The deltas ``text`` (the output's next piece) adds; all that is left once ``final``. The
        parsers read the whole output each time: a piece that adds nothing is not read again."""
        if not text and not final:
            return []
        self.text += text
        now = read_output(self.output, self.text, final)
        deltas: list[dict[str, Any]] = []
        if piece := grown(self.sent.reasoning, now.reasoning):
            deltas.append({"reasoning_content": piece, "reasoning": piece})
        if piece := grown(self.sent.content, now.content):
            deltas.append({"content": piece})
        for index, call in enumerate(now.calls):
            if index >= len(self.sent.calls):
                self.ids.append(new_call_id())
                deltas.append({"tool_calls": [{"index": index, "id": self.ids[index], "type": "function",
                                               "function": {"name": call.name, "arguments": ""}}]})
                before = ""
            else:
                before = self.sent.calls[index].arguments
            if piece := grown(before, call.arguments):
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
        self.sent = now
        return deltas


def calls_json(calls: tuple[ParsedCall, ...]) -> list[dict[str, Any]]:
    return [{"id": new_call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in calls]
