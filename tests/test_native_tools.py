"""Tools in the model's own format and reasoning, through a real server and the ``openai`` client.

The server (:mod:`scripted_model`) runs the tiny random model with a Hermes/Qwen-style chat template
and the ``qwen3`` reasoning parser; for requests whose ``seed`` names a script, an entry-point
plugin makes the model write what a Qwen3 model would. Everything after that plugin's logits
processor is the server's real path: the stream, the parsers, the shapes the client reads."""

from __future__ import annotations

import json

import httpx
import pytest
from scripted_model import ANSWERING, CALLING, SCRIPTS, THINKING_ANSWER, THINKING_JSON, start_scripted_server

openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    running = start_scripted_server(tiny_model_dir, tmp_path_factory,
                                    ["--reasoning-parser", "qwen3", "--enable-auto-tool-choice"])
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def ask(client, seed, **extra):
    return client.chat.completions.create(model="any", messages=QUESTION, tools=[WEATHER], temperature=0,
                                          max_tokens=120, seed=seed, **extra)


def test_info_names_the_parsers_the_template_and_flags_chose(server):
    info = httpx.get(f"{server.url}/info").json()
    assert (info["tool_call_parser"], info["reasoning_parser"]) == ("hermes", "qwen3")


def test_the_chat_template_shows_the_tools_and_no_instructions_of_the_server(server):
    body = {"model": "any", "messages": QUESTION, "tools": [WEATHER]}
    templated = httpx.post(f"{server.url}/chat_tokenize", json=body).json()["templated_text"]
    assert "<tools>" in templated and '"name": "get_weather"' in templated
    assert "You can call these functions" not in templated
    hidden = httpx.post(f"{server.url}/chat_tokenize", json={**body, "tool_choice": "none"}).json()["templated_text"]
    assert "<tools>" not in hidden


def test_an_auto_call_in_the_models_format_comes_back_as_tool_calls_with_the_reasoning_apart(client):
    reply = ask(client, CALLING)
    choice = reply.choices[0]
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather",
                                                                         {"city": "Paris", "unit": "celsius"})
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    assert choice.message.reasoning_content == "\nThe user asks about Paris.\n"
    reasoning_tokens = reply.usage.completion_tokens_details.reasoning_tokens
    assert 0 < reasoning_tokens < reply.usage.completion_tokens


def test_a_streamed_call_arrives_in_pieces_and_adds_up_to_the_whole_one(client):
    from openai.lib.streaming.chat import ChatCompletionStreamState

    whole = ask(client, CALLING).choices[0]
    chunks = list(ask(client, CALLING, stream=True))
    state = ChatCompletionStreamState()
    reasoning, argument_pieces = "", 0
    for chunk in chunks:
        state.handle_chunk(chunk)
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            argument_pieces += sum(1 for call in delta.tool_calls or [] if call.function.arguments)
    snapshot = state.current_completion_snapshot.choices[0]
    assert [(c.function.name, c.function.arguments) for c in snapshot.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert snapshot.message.content == "Let me check." and reasoning == whole.message.reasoning_content
    assert argument_pieces > 3 and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_lets_the_model_answer_in_text(client):
    choice = ask(client, ANSWERING).choices[0]
    assert choice.message.content == SCRIPTS[ANSWERING] and not choice.message.tool_calls
    assert choice.finish_reason == "stop" and choice.message.reasoning_content is None
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in ask(client, ANSWERING, stream=True)
                       if chunk.choices)
    assert streamed == SCRIPTS[ANSWERING]


def test_the_model_answers_with_the_tools_result_instead_of_calling_again(client, server):
    history = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    reply = client.chat.completions.create(model="any", messages=history, tools=[WEATHER], temperature=0,
                                           max_tokens=120, seed=THINKING_ANSWER)
    choice = reply.choices[0]
    assert choice.message.content == "It is sunny in Paris." and not choice.message.tool_calls
    assert choice.message.reasoning_content == "\nSunny, so say so.\n"
    templated = httpx.post(f"{server.url}/chat_tokenize", json={"messages": history, "tools": [WEATHER]}).json()
    assert '<tool_call>\n{"name": "get_weather"' in templated["templated_text"]
    assert "sunny, 21 C" in templated["templated_text"]


def test_thinking_switched_off_by_the_template_leaves_all_of_the_output_as_content(client, server):
    reply = ask(client, ANSWERING, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert reply.choices[0].message.content == SCRIPTS[ANSWERING]
    assert reply.choices[0].message.reasoning_content is None
    templated = httpx.post(f"{server.url}/chat_tokenize", json={
        "messages": QUESTION, "chat_template_kwargs": {"enable_thinking": False}}).json()["templated_text"]
    assert templated.endswith("<think>\n\n</think>\n\n")


def test_required_holds_the_output_to_a_valid_call_whatever_the_parser(client):
    import jsonschema

    # Thinking off: with it on, the grammar would first wait for a `</think>` this random model never writes.
    choice = client.chat.completions.create(model="any", messages=QUESTION, tools=[WEATHER], temperature=0,
                                            max_tokens=80, tool_choice="required",
                                            extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0]
    (call, *_) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    if choice.finish_reason == "tool_calls":
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_responses_and_chunks_keep_the_documented_shapes(server):
    from tokenmill.http.openai.schemas import ChatCompletion, ChatCompletionChunk

    body = {"model": "any", "messages": QUESTION, "tools": [WEATHER], "temperature": 0, "max_tokens": 120,
            "seed": CALLING}
    ChatCompletion.model_validate(httpx.post(f"{server.url}/v1/chat/completions", json=body).json())
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}) as stream:
        events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        ChatCompletionChunk.model_validate_json(event)


CITY = {"type": "json_schema", "json_schema": {"name": "city", "schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
    "additionalProperties": False}}}


def test_response_format_holds_the_answer_after_the_thinking_not_the_thinking(client):
    reply = client.chat.completions.create(model="any", messages=QUESTION, temperature=0, max_tokens=120,
                                           seed=THINKING_JSON, response_format=CITY)
    message = reply.choices[0].message
    assert message.reasoning_content == "\nThe city is Paris {not JSON yet}.\n"
    assert json.loads(message.content) == {"city": "Paris"} and reply.choices[0].finish_reason == "stop"


def test_with_thinking_off_the_grammar_holds_the_output_from_its_start(client):
    reply = client.chat.completions.create(model="any", messages=QUESTION, temperature=0, max_tokens=40,
                                           response_format=CITY,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = reply.choices[0].message
    assert message.content.startswith('{"city": "') and message.reasoning_content is None
