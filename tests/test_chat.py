"""Chat prompts, tool-call rules and stop handling of the OpenAI routes, without a server."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tokenmill.engine.stops import StopMatcher
from tokenmill.http.openai import StopHoldback
from tokenmill.http.openai.chat import (
    ChatError,
    parse_messages,
    parse_tool_call,
    parse_tools,
    render_prompt,
    tool_call_schema,
    tools_to_offer,
)

TOOLS = parse_tools([
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}},
])


class NoTemplate:
    chat_template = None


def test_a_tokenizer_without_a_chat_template_is_refused_with_the_way_out():
    with pytest.raises(ChatError, match="no chat template.*/v1/completions"):
        render_prompt(NoTemplate(), parse_messages([{"role": "user", "content": "hi"}]), [], True)


def test_messages_accept_text_parts_and_map_developer_to_system():
    messages = parse_messages([{"role": "developer", "content": "Be brief."},
                               {"role": "user",
                                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "ab"}]
    with pytest.raises(ChatError, match=r"messages\[0\].role"):
        parse_messages([{"role": "wizard", "content": "x"}])
    with pytest.raises(ChatError, match="only text"):
        parse_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_tool_choice_decides_what_the_output_may_be():
    assert tools_to_offer(TOOLS, None) == (TOOLS, True)
    assert tools_to_offer(TOOLS, "none") == ([], True)
    assert tools_to_offer(TOOLS, "required") == (TOOLS, False)
    assert tools_to_offer(TOOLS, {"type": "function", "function": {"name": "get_time"}}) == ([TOOLS[1]], False)
    with pytest.raises(ChatError, match="get_weather, get_time"):
        tools_to_offer(TOOLS, {"type": "function", "function": {"name": "launch_rocket"}})
    with pytest.raises(ChatError, match="needs `tools`"):
        tools_to_offer([], "required")


def test_the_call_schema_accepts_exactly_the_valid_calls_of_the_offered_tools():
    schema = tool_call_schema(TOOLS)
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Paris"}}, schema)
    jsonschema.validate({"name": "get_time", "arguments": {}}, schema)
    for wrong in ({"name": "get_weather", "arguments": {}}, {"name": "other", "arguments": {}},
                  {"name": "get_time", "arguments": {}, "extra": 1}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)


def test_an_output_is_a_call_only_when_it_is_a_whole_call_object():
    call = parse_tool_call('{"name": "get_weather", "arguments": {"city": "Paris"}}')
    assert call is not None and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert parse_tool_call("It is sunny.") is None
    assert parse_tool_call('{"name": "get_weather", "argu') is None  # cut short by max_tokens


def test_past_tool_calls_are_shown_as_the_json_the_model_writes_when_the_template_has_no_tool_support(tiny_model):
    _, tokenizer = tiny_model
    messages = parse_messages([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ])
    prompt = render_prompt(tokenizer, messages, TOOLS, True)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "You can call these functions" in prompt and prompt.endswith("<|im_start|>assistant\n")


def streamed(stops: tuple[str, ...], pieces: list[str]) -> tuple[list[str], StopHoldback]:
    """What a stream sends of each piece, given the engine's count of held-back characters."""
    matcher, holdback = StopMatcher(stops), StopHoldback(stops)
    sent = []
    for piece in pieces:
        matcher.feed(piece)
        sent.append(holdback.push(piece, matcher.held))
    return sent, holdback


def test_streamed_text_holds_back_what_may_begin_a_stop_sequence():
    pieces, holdback = streamed(("\n\nEND",), ["Hello", "\n", "\nE", "ND", " more"])
    assert pieces == ["Hello", "", "", "", ""] and holdback.finish() == ""
    pieces, holdback = streamed(("\n\nEND",), ["Hi", "\n", "x"])
    pieces.append(holdback.finish())
    assert "".join(pieces) == "Hi\nx" and pieces[1] == ""


def test_stop_sequences_are_found_one_character_at_a_time_in_linear_time():
    matcher = StopMatcher(("abab", "x" * 512))
    assert not matcher.feed("aba") and matcher.held == 3
    assert not matcher.feed("c") and matcher.held == 0
    assert matcher.feed("ababab")
    long = StopMatcher(("a" * 511 + "b",))
    assert not long.feed("a" * 100_000) and long.held == 511  # never searched again: one pass over the text
    assert long.feed("b")
