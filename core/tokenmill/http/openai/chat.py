"""Chat prompts and tool calls for the OpenAI routes.

A chat request becomes one prompt through the tokenizer's chat template. With a parser of the
model's own tool format and ``tool_choice`` ``auto``, the template alone shows the tools. Otherwise
they are shown to the model in a system message that also says how to call them (and through
the template too when it knows tools), and its output is held to a grammar: a call is a JSON object
``{"name": ..., "arguments": {...}}`` valid for one of the offered tools, and with
``parallel_tool_calls`` (OpenAI's default) several calls may follow, one per line; with
``tool_choice`` ``auto`` the model may instead answer in plain text (text that does
not start with ``{``). The ``tgi`` tool-call parser reads the calls back
(:mod:`tokenmill.http.openai.reading`); a parser of the model's own format reads ``auto`` outputs,
which no grammar holds, when the chat template shows the tools.
"""

from __future__ import annotations

import functools
import inspect
import json
import time
from typing import Any

from tokenmill.http.openai.schemas import ContentPart, Message, NamedToolChoice, ToolCall
from tokenmill.http.openai.schemas import Tool as ToolSpec
from tokenmill.interfaces.parsers import FunctionTool as Tool
from tokenmill.sampling.grammar import JSON_LAYOUT, Grammar, GrammarCompiler, GrammarError


class ChatError(ValueError):
    """The conversation or its tools cannot be turned into a prompt (answered with 422)."""


def message_text(content: str | list[ContentPart] | None, where: str, placeholder: str | None = None) -> str:
    """A message's content as text: a string, or the parts of a content list, each image part as
    ``placeholder`` (the text naming an image for a vision-language model; None: images are refused)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type == "text" and part.text is not None:
            texts.append(part.text)
        elif part.type == "image_url" and part.image_url is not None:
            if placeholder is None:
                raise ChatError(f"`{where}[{j}]`: this model takes no images (it is not a vision-language model)")
            texts.append(placeholder)
        else:
            raise ChatError(f"`{where}[{j}]`: a content part is {{\"type\": \"text\", \"text\": ...}}"
                            + (' or {"type": "image_url", "image_url": {"url": ...}}' if placeholder else ""))
    return "".join(texts)


def message_images(messages: list[Message]) -> list[str]:
    """The URLs of the conversation's image parts, in order (as :func:`message_text` placed them)."""
    return [part.image_url.url for message in messages if isinstance(message.content, list)
            for part in message.content if part.type == "image_url" and part.image_url is not None]


def parse_messages(messages: list[Message], placeholder: str | None = None) -> list[dict[str, Any]]:
    """Checked messages as the chat template expects them: role and text content (and tool calls), each
    image part as ``placeholder`` in the text (None: the model takes no images)."""
    parsed = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if message.content is None and message.tool_calls is None:  # only an assistant's tool calls go without
            raise ChatError(f"`{where}` must have `content` (or, from the assistant, `tool_calls`)")
        entry: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                                 "content": message_text(message.content, f"{where}.content", placeholder)}
        if message.tool_calls is not None:
            if message.role != "assistant":
                raise ChatError(f"`{where}.tool_calls` may only be on an assistant message")
            entry["tool_calls"] = [_history_call(call, f"{where}.tool_calls[{j}]")
                                   for j, call in enumerate(message.tool_calls)]
        if message.role == "tool" and message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        parsed.append(entry)
    return parsed


def _history_call(call: ToolCall, where: str) -> dict[str, Any]:
    arguments = call.function.arguments
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except ValueError:
            raise ChatError(f"`{where}.function.arguments` must be a JSON object text") from None
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


TOOLS_COMPILE_SECONDS = 2.0
"""The longest a request's tools may take to compile into its grammar (a 422 beyond)."""


def parse_tools(tools: list[ToolSpec]) -> list[Tool]:
    """The offered tools; a tool without parameters takes none. TGI reads a tool's parameters from
    ``parameters`` or, as its spec documents them, ``arguments``."""
    parsed = []
    for tool in tools:
        function = tool.function
        parameters = function.parameters if function.parameters is not None else function.arguments
        parsed.append(Tool(function.name, function.description or "",
                           parameters if parameters is not None else {"type": "object", "properties": {}}))
    if len({t.name for t in parsed}) != len(parsed):
        raise ChatError("`tools`: function names must be unique")
    return parsed


def tools_to_offer(tools: list[Tool], tool_choice: str | NamedToolChoice | None) -> tuple[list[Tool], bool]:
    """The tools the output may call and whether a plain-text answer is allowed instead."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return [], True
    if not tools:
        raise ChatError("`tool_choice` needs `tools`")
    if tool_choice == "auto":
        return tools, True
    if tool_choice == "required":
        return tools, False
    assert isinstance(tool_choice, NamedToolChoice)
    name = tool_choice.function.name
    named = [t for t in tools if t.name == name]
    if not named:
        raise ChatError(
            f"`tool_choice` names {name!r}, which is not among `tools` ({', '.join(t.name for t in tools)})")
    return named, False


def tool_call_schema(tools: list[Tool]) -> dict[str, Any]:
    """A JSON schema that accepts exactly the valid calls of ``tools``."""
    calls = [{
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    } for tool in tools]
    return {"anyOf": calls, "x-guidance": JSON_LAYOUT}


def tool_grammar(compiler: GrammarCompiler, tools: list[Tool], text_allowed: bool, parallel: bool = True) -> Grammar:
    """The grammar of the output: a valid call of one of ``tools`` (``parallel``: one or more, a line
    each), or, when allowed, plain text."""
    if not compiler.disabled:
        try:
            compiler.ll_tokenizer()  # the token table, built once per tokenizer, is no cost of these tools
        except GrammarError as error:
            raise ChatError(f"`tools`: {error}") from None
    deadline = time.monotonic() + TOOLS_COMPILE_SECONDS
    for tool in tools:  # each schema alone first, so that a broken one is named
        try:
            compiler.json_schema(tool.parameters)
        except GrammarError as error:
            raise ChatError(f"`tools`: the parameters of {tool.name!r}: {error}") from None
        if time.monotonic() > deadline:
            raise ChatError(f"`tools`: compiling their grammar takes longer than the limit of "
                            f"{TOOLS_COMPILE_SECONDS:g} s; offer fewer or simpler tools")
    call = "call: %json " + json.dumps(tool_call_schema(tools)) + "\n"
    calls = 'calls: call ("\\n" call)*\n' if parallel else "calls: call\n"
    if not text_allowed:
        return compiler.lark("start: calls\n" + calls + call)
    # A plain answer is any text that does not open a JSON object, so its first visible character decides.
    return compiler.lark("start: calls | answer\n" + calls + call + "answer: /\\s*[^{\\s][\\s\\S]*/\n")


def tools_instruction(tools: list[Tool], text_allowed: bool, parallel: bool = True,
                      lead_in: str | None = None) -> str:
    """What the model reads about the tools: ``lead_in`` (TGI's ``tool_prompt``; default: tokenmill's own
    line), the tools, and how to call them (the format the grammar holds the output to)."""
    listing = json.dumps([{"name": t.name, "description": t.description, "parameters": t.parameters} for t in tools])
    several = ("If the question needs several calls, write each on its own line, and no call twice. "
               if parallel else "")
    ending = ("If none of them helps, answer the user in plain text instead." if text_allowed
              else "You must call one of them.")
    return ((lead_in or "You can call these functions:") + "\n" + listing + "\n"
            'To call one, reply with only a JSON object: {"name": <function name>, "arguments": <its arguments>}. '
            + several + ending)


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]], tools: list[Tool], text_allowed: bool,
                  parallel: bool = True, template_kwargs: dict[str, Any] | None = None,
                  tool_prompt: str | None = None, native: bool = False, add_generation_prompt: bool = True,
                  continue_final_message: bool = False, placeholder: str | None = None) -> str:
    """The prompt text for ``messages``: the chat template with the assistant's turn opened.
    ``template_kwargs`` (vLLM's ``chat_template_kwargs``) are extra variables the template sees;
    ``tool_prompt`` (TGI's) leads in the tools. ``native``: the template alone shows the tools, and
    the model calls them in its own format (no system message about the grammar's). A chat request
    always opens the assistant's turn; vLLM's ``/tokenize`` may ask for neither or to continue the
    last message. ``placeholder``: a vision-language model's image text, which its template takes as
    ``{"type": "image"}`` parts (every message's content becomes a list of parts, as such templates expect)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ChatError("this model's tokenizer has no chat template: use /v1/completions or /generate with a prompt")
    if isinstance(template, dict):  # named templates: what they say about tools is in their texts
        template = "\n".join(template.values())
    if "tool_calls" not in template:
        messages = [_calls_as_text(m) for m in messages]
    kwargs: dict[str, Any] = dict(template_kwargs or {})
    if tools and not native:
        # Say how to call, even to a template that knows tools: the grammar wants our format, not its own.
        messages = _with_system_note(messages, tools_instruction(tools, text_allowed, parallel, tool_prompt))
    if tools and (native or "tools" in template):
        kwargs["tools"] = [tool.as_openai() for tool in tools]
    if placeholder is not None:
        messages = [_as_parts(m, placeholder) for m in messages]
    try:
        if continue_final_message:
            kwargs["continue_final_message"] = True
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt and
                                             not continue_final_message, tokenize=False, **kwargs)
    except Exception as error:  # noqa: BLE001 - templates raise whatever jinja raises on a bad conversation
        raise ChatError(f"the chat template refused the conversation: {error}") from None


def _as_parts(message: dict[str, Any], placeholder: str) -> dict[str, Any]:
    """A message whose text content is split into text parts and ``{"type": "image"}`` parts."""
    pieces = message["content"].split(placeholder)
    parts: list[dict[str, Any]] = []
    for index, piece in enumerate(pieces):
        if index:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return {**message, "content": parts}


def _calls_as_text(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant turn's tool calls written as the JSON the model is asked to produce."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    text = "\n".join(json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
                     for c in calls)
    return {"role": message["role"], "content": (message["content"] + "\n" + text).strip()}


def _with_system_note(messages: list[dict[str, Any]], note: str) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": (messages[0]["content"] + "\n\n" + note).strip()}
        return [first] + messages[1:]
    return [{"role": "system", "content": note}] + messages


TEMPLATE_VARIABLES_OF_THE_CALL = frozenset({"messages", "conversation", "conversations", "tools", "documents"})
"""What the template call itself passes to the template (besides ``apply_chat_template``'s own arguments)."""


@functools.cache
def _reserved_template_names(tokenizer_type: type) -> frozenset[str]:
    signature = inspect.signature(tokenizer_type.apply_chat_template)
    own = {name for name, p in signature.parameters.items() if p.kind is not p.VAR_KEYWORD and name != "self"}
    return frozenset(own) | TEMPLATE_VARIABLES_OF_THE_CALL


def template_kwargs(tokenizer: Any, value: dict[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs`` checked: an object whose keys are extra template variables (such as
    ``enable_thinking``), none of them one the template call sets itself (that would change how the
    prompt is built, e.g. ``tokenize`` or ``add_generation_prompt``)."""
    if value is None:
        return {}
    taken = sorted(set(value) & _reserved_template_names(type(tokenizer)))
    if taken:
        raise ChatError(f"`chat_template_kwargs` may not set {', '.join(taken)}: the server sets "
                        f"{'it' if len(taken) == 1 else 'them'} when it renders the chat template")
    return value
