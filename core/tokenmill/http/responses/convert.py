"""A Responses request as an OpenAI chat request: ``input`` (text or items: messages, function calls
and their outputs) after the stored conversation of ``previous_response_id``, ``instructions`` as a
system message for this response only, function tools, ``text.format`` as ``response_format``."""

from __future__ import annotations

from typing import Any

from tokenmill.http.responses.schemas import InputItem, ResponsesRequest
from tokenmill.http.schemas import ValidationError
from tokenmill.interfaces.parsers import FunctionTool

TEXT_PARTS = ("input_text", "output_text", "text")
NO_PARAMETERS = {"type": "object", "properties": {}}


def chat_content(content: str | list[dict[str, Any]], where: str) -> str | list[dict[str, Any]]:
    """A message's content as chat content: its text, or (with ``input_image`` parts) chat's text and
    ``image_url`` parts."""
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        if part.get("type") == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        elif part.get("type") in TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise ValidationError(f"`{where}[{i}]`: only text parts and input_image parts with an `image_url` are "
                                  f"supported, got {part.get('type')!r}")
    if any(part["type"] == "image_url" for part in parts):
        return parts
    return "".join(part["text"] for part in parts)


def input_messages(items: str | list[InputItem]) -> list[dict[str, Any]]:
    """The input as chat messages; consecutive function calls join one assistant turn."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where, kind = f"input[{i}]", item.type or "message"
        if kind == "message":
            if item.role is None or item.content is None:
                raise ValidationError(f"`{where}`: a message needs `role` and `content`")
            messages.append({"role": item.role, "content": chat_content(item.content, f"{where}.content")})
        elif kind == "function_call":
            if not item.call_id or not item.name:
                raise ValidationError(f"`{where}`: a function_call needs `call_id` and `name`")
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments or "{}"}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not item.call_id or item.output is None:
                raise ValidationError(f"`{where}`: a function_call_output needs `call_id` and `output`")
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": chat_content(item.output, f"{where}.output")})
    return messages


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as the chat route's ``response_format`` (None: plain text)."""
    form = (text or {}).get("format")
    if form is None:
        return None
    if not isinstance(form, dict) or form.get("type") not in ("text", "json_object", "json_schema"):
        raise ValidationError('`text.format.type` must be "text", "json_object" or "json_schema"')
    if form["type"] == "text":
        return None
    if form["type"] == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": form.get("name", "output"), "schema": form.get("schema")}}


def chat_body(request: ResponsesRequest, history: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The chat request body, and the conversation it holds (without this response's instructions),
    which the store keeps for a later ``previous_response_id``."""
    conversation = history + input_messages(request.input)
    system = [{"role": "system", "content": request.instructions}] if request.instructions else []
    body: dict[str, Any] = {"messages": system + conversation, "stream": request.stream}
    if request.model is not None:
        body["model"] = request.model
    if request.tools:
        body["tools"] = [FunctionTool(tool.name, tool.description or "", tool.parameters or NO_PARAMETERS).as_openai()
                         for tool in request.tools]
    choice = request.tool_choice
    if choice is not None:
        body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                        "function": {"name": choice.name}}
    for name, field in (("parallel_tool_calls", "parallel_tool_calls"), ("max_tokens", "max_output_tokens"),
                        ("temperature", "temperature"), ("top_p", "top_p"), ("seed", "seed"),
                        ("chat_template_kwargs", "chat_template_kwargs")):
        if getattr(request, field) is not None:
            body[name] = getattr(request, field)
    if (form := response_format(request.text)) is not None:
        body["response_format"] = form
    return body, conversation
