"""Anthropic's Messages API (``/v1/messages``) through the ``anthropic`` client, on the scripted server
(:mod:`scripted_model`): text, thinking, tool use and tool results, streamed and whole, and
``count_tokens``. The conversion runs the chat path, so the answers are the chat route's."""

from __future__ import annotations

import json

import httpx
import pytest
from scripted_model import ANSWERING, CALLING, SCRIPTS, THINKING_ANSWER, start_scripted_server

anthropic = pytest.importorskip("anthropic")

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
API_KEY = "sk-messages-test"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    running = start_scripted_server(tiny_model_dir, tmp_path_factory,
                                    ["--reasoning-parser", "qwen3", "--api-key", API_KEY])
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)


def ask(client, seed, **extra):
    """A scripted answer: the seed (an extra field, as vLLM takes it) picks the script. This client
    version no longer sends ``temperature`` itself, so it goes as an extra field too."""
    return client.messages.create(model="any", max_tokens=120, messages=extra.pop("messages", QUESTION),
                                  tools=[WEATHER], extra_body={"seed": seed, "temperature": 0}, **extra)


def test_a_text_answer_is_one_text_block_ending_the_turn(client):
    message = ask(client, ANSWERING)
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == SCRIPTS[ANSWERING] and message.stop_reason == "end_turn"
    assert message.role == "assistant" and message.id.startswith("msg_")
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > len(SCRIPTS[ANSWERING]) // 8


def test_a_tool_call_is_a_tool_use_block_after_the_thinking_and_the_text(client):
    message = ask(client, CALLING)
    assert [block.type for block in message.content] == ["thinking", "text", "tool_use"]
    thinking, text, call = message.content
    assert thinking.thinking == "\nThe user asks about Paris.\n" and text.text == "Let me check."
    assert (call.name, call.input) == ("get_weather", {"city": "Paris", "unit": "celsius"})
    assert call.id.startswith("toolu_") and message.stop_reason == "tool_use"


def test_the_stream_adds_up_to_the_same_message(client):
    whole = ask(client, CALLING)
    with client.messages.stream(model="any", max_tokens=120, messages=QUESTION, tools=[WEATHER],
                                extra_body={"seed": CALLING, "temperature": 0}) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert [block.type for block in streamed.content] == ["thinking", "text", "tool_use"]
    assert streamed.content[0].thinking == whole.content[0].thinking
    assert streamed.content[1].text == whole.content[1].text
    assert streamed.content[2].input == whole.content[2].input and streamed.stop_reason == "tool_use"
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 3
    assert streamed.usage.output_tokens == whole.usage.output_tokens


def test_a_tool_result_goes_back_to_the_model_as_the_tools_message(client, server):
    history = QUESTION + [
        {"role": "assistant", "content": [{"type": "text", "text": "Let me check."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"}]}]
    message = ask(client, THINKING_ANSWER, messages=history)
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[1].text == "It is sunny in Paris." and message.stop_reason == "end_turn"
    counted = client.messages.count_tokens(model="any", messages=history, tools=[WEATHER]).input_tokens
    assert counted == message.usage.input_tokens


def test_stop_sequences_and_max_tokens_say_why_the_turn_ended(client):
    stopped = ask(client, ANSWERING, stop_sequences=[", 21"])
    assert stopped.content[0].text == "It is sunny in Paris"
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", ", 21")
    cut = client.messages.create(model="any", max_tokens=3, messages=QUESTION, extra_body={"temperature": 0})
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3


def test_system_text_and_tool_choice_reach_the_prompt(server):
    headers = {"x-api-key": API_KEY}
    body = {"model": "any", "messages": QUESTION, "system": "Answer in French.", "tools": [WEATHER]}
    shown = httpx.post(f"{server.url}/v1/messages/count_tokens", json=body, headers=headers).json()["input_tokens"]
    hidden = httpx.post(f"{server.url}/v1/messages/count_tokens", json={**body, "tool_choice": {"type": "none"}},
                        headers=headers).json()["input_tokens"]
    bare = httpx.post(f"{server.url}/v1/messages/count_tokens", json={"model": "any", "messages": QUESTION},
                      headers=headers).json()["input_tokens"]
    assert shown > hidden > bare


def test_required_tool_use_is_held_to_a_valid_call(client):
    # Thinking off: with it on, the grammar would first wait for a `</think>` this random model never writes.
    message = client.messages.create(model="any", max_tokens=80, messages=QUESTION, tools=[WEATHER],
                                     tool_choice={"type": "tool", "name": "get_weather"},
                                     thinking={"type": "disabled"}, extra_body={"temperature": 0})
    calls = [block for block in message.content if block.type == "tool_use"]
    assert calls and calls[0].name == "get_weather"


@pytest.mark.parametrize("body, message", [
    ({"messages": QUESTION}, "max_tokens"),
    ({"messages": QUESTION, "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "system", "content": "x"}], "max_tokens": 5}, "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 5},
     '`messages[0].content[0].source` must be {"type": "base64"'),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "data:,"}}]}],
      "max_tokens": 5}, "takes no images"),
    ({"messages": QUESTION, "max_tokens": 5, "tool_choice": {"type": "tool"}}, "needs the tool's `name`"),
])
def test_a_bad_request_is_a_422_that_names_the_field(server, body, message):
    response = httpx.post(f"{server.url}/v1/messages", json={"model": "any", **body}, headers={"x-api-key": API_KEY})
    assert response.status_code == 422, response.text
    assert response.json()["error_type"] == "validation" and message in response.json()["error"]


def test_the_api_key_is_read_from_either_header(server):
    body = {"model": "any", "messages": QUESTION, "max_tokens": 2}
    assert httpx.post(f"{server.url}/v1/messages", json=body).status_code == 401
    assert httpx.post(f"{server.url}/v1/messages", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    assert json.loads(httpx.post(f"{server.url}/v1/messages", json=body,
                                 headers={"x-api-key": API_KEY}).text)["type"] == "message"
