"""The Responses API's ``response`` object and stream events, from the engine's results and token
events, read with the chat route's parsers: reasoning is a ``reasoning`` item, text a ``message``
item, each call a ``function_call`` item. Items are numbered in output order, and their ids come
from the response's id and that number, so a stream's items and its final response agree."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.engine.sequence import FINISH_LENGTH, FinalResult, TokenEvent
from tokenmill.http.openai.convert import OpenAIJob
from tokenmill.http.openai.reading import OutputReader, ReadOutput
from tokenmill.http.openai.shapes import StopHoldback, final_output, reasoning_tokens
from tokenmill.http.responses.schemas import ResponsesRequest


@dataclass
class ResponsesJob:
    """A Responses request run as a chat job, with what its response echoes and stores."""

    job: OpenAIJob
    request: ResponsesRequest
    conversation: list[dict[str, Any]]
    created_at: int = field(default_factory=lambda: int(time.time()))

    @property
    def id(self) -> str:
        return f"resp_{self.job.id}"

    def item_id(self, prefix: str, index: int) -> str:
        return f"{prefix}_{self.job.id}{index}"


def reasoning_item(rjob: ResponsesJob, index: int, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": rjob.item_id("rs", index), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(rjob: ResponsesJob, index: int, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": rjob.item_id("msg", index), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def call_item(rjob: ResponsesJob, index: int, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": rjob.item_id("fc", index), "call_id": rjob.item_id("call", index),
            "name": name, "arguments": arguments, "status": status}


def output_items(rjob: ResponsesJob, read: ReadOutput) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if read.reasoning:
        items.append(reasoning_item(rjob, len(items), read.reasoning))
    if read.content or not read.calls:
        items.append(message_item(rjob, len(items), read.content))
    for call in read.calls:
        items.append(call_item(rjob, len(items), call.name, call.arguments))
    return items


def response_json(rjob: ResponsesJob, result: FinalResult | None, status: str = "completed") -> dict[str, Any]:
    """The ``response`` object: whole once ``result`` is known, else as it starts (no output yet)."""
    request, job = rjob.request, rjob.job
    items: list[dict[str, Any]] = []
    usage = None
    incomplete = None
    if result is not None:
        text, read = final_output(result, job, job.requests[0].stop)
        items = output_items(rjob, read)
        if result.finish_reason == FINISH_LENGTH:
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        prompt = len(job.requests[0].input_ids)
        usage = {"input_tokens": prompt, "output_tokens": result.generated_tokens,
                 "total_tokens": prompt + result.generated_tokens,
                 "input_tokens_details": {"cached_tokens": result.cached_tokens},
                 "output_tokens_details": {"reasoning_tokens": reasoning_tokens(result, text, read)}}
    return {"id": rjob.id, "object": "response", "created_at": rjob.created_at, "status": status, "model": job.model,
            "output": items, "usage": usage, "error": None, "incomplete_details": incomplete,
            "instructions": request.instructions, "metadata": request.metadata or {},
            "previous_response_id": request.previous_response_id, "store": request.store,
            "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or []],
            "tool_choice": (request.tool_choice if isinstance(request.tool_choice, str) or request.tool_choice is None
                            else request.tool_choice.model_dump()) or "auto",
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "temperature": request.temperature, "top_p": request.top_p,
            "max_output_tokens": request.max_output_tokens, "text": request.text or {"format": {"type": "text"}}}


def answer_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The response's output as the chat messages a next turn shows the model (its reasoning not)."""
    text = "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                      "arguments": item["arguments"]}}
             for item in items if item["type"] == "function_call"]
    return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]


class ResponseStream:
    """A streamed response's events, ``(type, data)``, each data with its ``sequence_number``."""

    def __init__(self, rjob: ResponsesJob) -> None:
        self.rjob = rjob
        job = rjob.job
        self.request = job.requests[0]
        self.holdback = StopHoldback(self.request.stop)
        self.reader = OutputReader(job.output)
        self.markers = job.output.special_texts
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        """The item being written, its text so far in it (``reasoning_text``, ``text`` or ``arguments``)."""
        self.sequence = 0
        self.final: dict[str, Any] | None = None
        """The whole response, once the last token came."""

    def _event(self, kind: str, **data: Any) -> tuple[str, dict[str, Any]]:
        self.sequence += 1
        return kind, {"type": kind, "sequence_number": self.sequence - 1, **data}

    def opening(self) -> list[tuple[str, dict[str, Any]]]:
        started = response_json(self.rjob, None, status="in_progress")
        return [self._event("response.created", response=started),
                self._event("response.in_progress", response=started)]

    def on_event(self, event: TokenEvent) -> list[tuple[str, dict[str, Any]]]:
        token = event.token
        shown = not token.special or token.text in self.markers
        text = self.holdback.push(token.text, event.held) if shown else ""
        if event.final is not None:
            text += self.holdback.finish()
        if self.rjob.job.output.reads:
            deltas = self.reader.push(text, event.final is not None)
        else:
            deltas = [{"content": text}] if text else []
        events = [item for delta in deltas for item in self._delta(delta)]
        if event.final is not None:
            events += self._close()
            self.final = response_json(self.rjob, event.final)
            kind = "response.completed" if self.final["status"] == "completed" else "response.incomplete"
            events.append(self._event(kind, response=self.final))
        return events

    def _delta(self, delta: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        if "reasoning_content" in delta:
            return self._write("reasoning", delta["reasoning_content"])
        if "content" in delta:
            return self._write("message", delta["content"])
        (call,) = delta["tool_calls"]
        if "id" in call:
            events = self._close()
            item = call_item(self.rjob, len(self.items), call["function"]["name"], "", status="in_progress")
            self.items.append(item)
            self.open = item
            return events + [self._event("response.output_item.added", output_index=len(self.items) - 1, item=item)]
        return self._write("function_call", call["function"]["arguments"])

    def _write(self, kind: str, piece: str) -> list[tuple[str, dict[str, Any]]]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events = self._close()
            events += self._start(kind)
        item, index = self.open, len(self.items) - 1
        assert item is not None
        if kind == "reasoning":
            item["content"][0]["text"] += piece
            events.append(self._event("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                                      content_index=0, delta=piece))
        elif kind == "message":
            item["content"][0]["text"] += piece
            events.append(self._event("response.output_text.delta", item_id=item["id"], output_index=index,
                                      content_index=0, delta=piece, logprobs=[]))
        else:
            item["arguments"] += piece
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=index, delta=piece))
        return events

    def _start(self, kind: str) -> list[tuple[str, dict[str, Any]]]:
        index = len(self.items)
        if kind == "reasoning":
            item = reasoning_item(self.rjob, index, "")
        else:
            item = message_item(self.rjob, index, "", status="in_progress")
        self.items.append(item)
        self.open = item
        events = [self._event("response.output_item.added", output_index=index, item=item)]
        if kind == "message":
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                      content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return events

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        item, index = self.open, len(self.items) - 1
        if item is None:
            return []
        self.open = None
        events = []
        if item["type"] == "reasoning":
            events.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=item["content"][0]["text"]))
        elif item["type"] == "message":
            part = item["content"][0]
            events += [self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=part["text"], logprobs=[]),
                       self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=part)]
        else:
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, arguments=item["arguments"]))
        if "status" in item:  # messages and calls have one, reasoning items not
            item["status"] = "completed"
        return events + [self._event("response.output_item.done", output_index=index, item=item)]
