"""Anthropic's response and stream shapes, from the engine's results and token events, read with
the same parsers as a chat completion: reasoning becomes a ``thinking`` block, text a ``text`` block,
each call a ``tool_use`` block."""

from __future__ import annotations

import json
from typing import Any

from tokenmill.engine.sequence import FINISH_LENGTH, FinalResult, TokenEvent
from tokenmill.http.openai.convert import OpenAIJob
from tokenmill.http.openai.reading import OutputReader
from tokenmill.http.openai.shapes import StopHoldback, final_output

STOP_SEQUENCE = "stop_sequence"


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def arguments_object(arguments: str) -> Any:
    """A call's input as JSON (its text, cut short by ``max_tokens``, reads as an empty object)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return {}


def stop_reason(result: FinalResult, called: bool, stops: tuple[str, ...]) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence``."""
    if result.finish_reason == FINISH_LENGTH:
        return "max_tokens", None
    if called:
        return "tool_use", None
    if result.finish_reason == STOP_SEQUENCE:
        return "stop_sequence", next((stop for stop in stops if stop in result.generated_text), None)
    return "end_turn", None


def usage(job: OpenAIJob, output_tokens: int, result: FinalResult | None) -> dict[str, int]:
    return {"input_tokens": len(job.requests[0].input_ids), "output_tokens": output_tokens,
            "cache_read_input_tokens": result.cached_tokens if result is not None else 0}


def message_json(job: OpenAIJob, result: FinalResult) -> dict[str, Any]:
    """A whole ``message`` response."""
    request = job.requests[0]
    _, read = final_output(result, job, request.stop)
    content: list[dict[str, Any]] = []
    if read.reasoning:
        content.append({"type": "thinking", "thinking": read.reasoning, "signature": ""})
    if read.content or not read.calls:
        content.append({"type": "text", "text": read.content})
    for number, call in enumerate(read.calls):
        content.append({"type": "tool_use", "id": tool_use_id(f"{job.id}{number}"), "name": call.name,
                        "input": arguments_object(call.arguments)})
    reason, sequence = stop_reason(result, read.finished_calls, request.stop)
    return {"id": f"msg_{job.id}", "type": "message", "role": "assistant", "model": job.model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage(job, result.generated_tokens, result)}


class MessageStream:
    """A streamed message's events, ``(event name, data)``: ``message_start``, each block's
    ``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta`` (stop reason, usage) and
    ``message_stop``."""

    def __init__(self, job: OpenAIJob) -> None:
        self.job = job
        self.request = job.requests[0]
        self.holdback = StopHoldback(self.request.stop)
        self.reader = OutputReader(job.output)
        self.markers = job.output.special_texts
        self.block: str | None = None
        """The kind of the block open now (``thinking``, ``text``, ``tool_use``), None between blocks."""
        self.index = -1
        self.output_tokens = 0

    def opening(self) -> list[tuple[str, dict[str, Any]]]:
        message = {"id": f"msg_{self.job.id}", "type": "message", "role": "assistant", "model": self.job.model,
                   "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage(self.job, 0, None)}
        return [("message_start", {"type": "message_start", "message": message})]

    def on_event(self, event: TokenEvent) -> list[tuple[str, dict[str, Any]]]:
        self.output_tokens += 1
        token = event.token
        shown = not token.special or token.text in self.markers
        text = self.holdback.push(token.text, event.held) if shown else ""
        final = event.final
        if final is not None:
            text += self.holdback.finish()
        if self.job.output.reads:
            deltas = self.reader.push(text, final is not None)
        else:
            deltas = [{"content": text}] if text else []
        events = [item for delta in deltas for item in self._delta(delta)]
        if final is not None:
            events += self._close()
            reason, sequence = stop_reason(final, self.reader.sent.finished_calls, self.request.stop)
            events += [("message_delta", {"type": "message_delta",
                                          "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                          "usage": {"output_tokens": self.output_tokens}}),
                       ("message_stop", {"type": "message_stop"})]
        return events

    def _delta(self, delta: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        if "reasoning_content" in delta:
            return self._in_block("thinking", {"type": "thinking", "thinking": "", "signature": ""},
                                  {"type": "thinking_delta", "thinking": delta["reasoning_content"]})
        if "content" in delta:
            return self._in_block("text", {"type": "text", "text": ""},
                                  {"type": "text_delta", "text": delta["content"]})
        (call,) = delta["tool_calls"]
        if "id" in call:
            events = self._close()
            self.block, self.index = "tool_use", self.index + 1
            block = {"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"], "input": {}}
            return events + [("content_block_start", {"type": "content_block_start", "index": self.index,
                                                      "content_block": block})]
        return [("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                         "delta": {"type": "input_json_delta",
                                                   "partial_json": call["function"]["arguments"]}})]

    def _in_block(self, kind: str, start: dict[str, Any], delta: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        events = []
        if self.block != kind:
            events = self._close()
            self.block, self.index = kind, self.index + 1
            events.append(("content_block_start", {"type": "content_block_start", "index": self.index,
                                                   "content_block": start}))
        return events + [("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                  "delta": delta})]

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        if self.block is None:
            return []
        self.block = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]
