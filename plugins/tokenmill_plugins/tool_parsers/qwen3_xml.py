"""The ``qwen3_xml`` tool-call parser (also ``qwen3_coder``): Qwen3-Coder's XML calls,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's text is turned into JSON by the type the tool's schema gives it: a string stays a
string, anything else is read as JSON (a string where that fails). Arguments grow a parameter at a
time, so a stream sends each one once it is closed."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import tokenmill
from tokenmill.interfaces.parsers import FunctionTool, ParsedCall, ParsedOutput, ToolParser
from tokenmill.parsing.markers import first_of, lead

CALL, FUNCTION, FUNCTION_END = "<tool_call>", "<function=", "</function>"
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


class QwenXmlParser(ToolParser):
    description = "<function=name><parameter=key>value</parameter></function> (Qwen3-Coder)"
    order = 30

    def __init__(self, name: str) -> None:
        self.name = name

    def detects(self, chat_template: str) -> bool:
        return self.name == "qwen3_xml" and FUNCTION in chat_template

    def parse(self, text: str, tools: Sequence[FunctionTool], final: bool) -> ParsedOutput:
        first, _ = first_of(text, (CALL, FUNCTION))
        schemas = {tool.name: tool.parameters for tool in tools}
        calls: list[ParsedCall] = []
        at = text.find(FUNCTION, first) if first >= 0 else -1
        while at >= 0:
            name_end = text.find(">", at)
            if name_end < 0:
                break
            name = text[at + len(FUNCTION): name_end].strip()
            close = text.find(FUNCTION_END, name_end)
            body = text[name_end + 1: close if close >= 0 else len(text)]
            calls.append(ParsedCall(name, arguments(body, schemas.get(name, {}), close >= 0 or final), close >= 0))
            at = text.find(FUNCTION, close) if close >= 0 else -1
        if final and not calls:
            return ParsedOutput(text)
        return ParsedOutput(lead(text, first, (CALL, FUNCTION), final), tuple(calls))


def arguments(body: str, schema: dict[str, Any], closed: bool) -> str:
    """The closed parameters of ``body`` as a JSON object's text (its ``}`` once ``closed``)."""
    properties = schema.get("properties", {}) if isinstance(schema, dict) else {}
    members = [f"{json.dumps(key.strip())}: {json.dumps(typed(value, properties.get(key.strip(), {})))}"
               for key, value in PARAMETER.findall(body)]
    return "{" + ", ".join(members) + ("}" if closed else "")


def typed(value: str, schema: Any) -> Any:
    """A parameter's text as its schema's type says (one newline each side is the format's)."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string":
        return value
    if kind == "boolean" and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    try:
        return json.loads(value)
    except ValueError:
        return value


@tokenmill.hookimpl
def tokenmill_tool_parsers() -> list[ToolParser]:
    return [QwenXmlParser("qwen3_xml"), QwenXmlParser("qwen3_coder")]
