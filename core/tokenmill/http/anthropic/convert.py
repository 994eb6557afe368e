"""Anthropic's Messages request as an OpenAI chat request: system text, content blocks (text,
``tool_use`` in the assistant's turns, ``tool_result`` in the user's), tools with ``input_schema``,
``tool_choice`` and the sampling fields. The chat path then renders, validates and runs it."""

from __future__ import annotations

from typing import Any

from tokenmill.http.anthropic.schemas import AnthropicMessage, ContentBlock, MessagesInput, MessagesRequest
from tokenmill.http.schemas import ValidationError
from tokenmill.interfaces.parsers import FunctionTool

SAMPLING_EXTRAS = ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens",
                   "ignore_eos", "cache_salt")
"""Fields Anthropic's API lacks that vLLM's /v1/messages passes on to sampling, as the chat route reads them."""

TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
"""Anthropic's tool choice → OpenAI's (``tool`` names a function)."""


def text_of(content: str | list[ContentBlock] | list[dict[str, Any]], where: str) -> str:
    """The text of a string or of text blocks (a tool result's content may be either)."""
    if isinstance(content, str):
        return content
    texts = []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else block.type
        text = block.get("text") if isinstance(block, dict) else block.text
        if kind != "text" or not isinstance(text, str):
            raise ValidationError(f"`{where}[{i}]`: only text blocks are supported here, got {kind!r}")
        texts.append(text)
    return "".join(texts)


def chat_messages(message: AnthropicMessage, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as OpenAI chat messages: a user's tool results become ``tool`` messages
    (before the user's text), an assistant's ``tool_use`` blocks its ``tool_calls``; thinking blocks
    from earlier turns are not shown again."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts: list[str] = []
    parts: list[dict[str, Any]] = []  # text and images in their order, where there are images
    results: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for i, block in enumerate(message.content):
        at = f"{where}.content[{i}]"
        if block.type == "text":
            texts.append(block.text or "")
            parts.append({"type": "text", "text": block.text or ""})
        elif block.type == "image" and message.role == "user":
            parts.append({"type": "image_url", "image_url": {"url": image_url(block.source, at)}})
        elif block.type == "tool_use" and message.role == "assistant":
            if not block.id or not block.name:
                raise ValidationError(f"`{at}`: a tool_use block needs `id` and `name`")
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": block.input or {}}})
        elif block.type == "tool_result" and message.role == "user":
            if not block.tool_use_id:
                raise ValidationError(f"`{at}`: a tool_result block needs `tool_use_id`")
            results.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": text_of(block.content or "", f"{at}.content")})
        elif block.type not in ("thinking", "redacted_thinking"):
            raise ValidationError(f"`{at}`: {block.type} blocks are not supported in a {message.role} message")
    chat = list(results)
    images = len(parts) > len(texts)  # parts holds the text blocks and the image ones
    if message.role == "assistant" and (texts or calls):
        turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
        if calls:
            turn["tool_calls"] = calls
        chat.append(turn)
    elif texts or images or not results:
        chat.append({"role": message.role, "content": parts if images else "".join(texts)})
    return chat


def image_url(source: dict[str, Any] | None, where: str) -> str:
    """An image block's source as the URL a chat image part names: base64 data as a data URL."""
    source = source or {}
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        return f"data:{source.get('media_type') or 'image/png'};base64,{source['data']}"
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise ValidationError(f'`{where}.source` must be {{"type": "base64", "media_type": ..., "data": ...}} or '
                          '{"type": "url", "url": ...}')


def chat_body(request: MessagesInput) -> dict[str, Any]:
    """The OpenAI chat request body ``request`` asks for."""
    messages: list[dict[str, Any]] = []
    if request.system is not None:
        messages.append({"role": "system", "content": text_of(request.system, "system")})
    for i, message in enumerate(request.messages):
        messages += chat_messages(message, f"messages[{i}]")
    body: dict[str, Any] = {"messages": messages}
    if request.model is not None:
        body["model"] = request.model
    if request.tools:
        body["tools"] = [FunctionTool(tool.name, tool.description or "", tool.input_schema).as_openai()
                         for tool in request.tools]
    choice = request.tool_choice
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise ValidationError('`tool_choice`: {"type": "tool"} needs the tool\'s `name`')
        body["tool_choice"] = (TOOL_CHOICES[choice.type] if choice.type != "tool"
                               else {"type": "function", "function": {"name": choice.name}})
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    if request.thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": request.thinking.get("type") == "enabled"}
    if isinstance(request, MessagesRequest):
        body.update({"max_tokens": request.max_tokens, "stream": request.stream,
                     "stop": list(request.stop_sequences or [])})
        for name in ("temperature", "top_p", "top_k", "seed"):
            if getattr(request, name) is not None:
                body[name] = getattr(request, name)
        extras = request.model_extra or {}
        body.update({name: extras[name] for name in SAMPLING_EXTRAS if name in extras})
    return body
