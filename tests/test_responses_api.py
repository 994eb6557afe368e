"""OpenAI's Responses API (``/v1/responses``) through the ``openai`` client's ``responses``, on the
scripted server (:mod:`scripted_model`): text, reasoning and function calls, whole and streamed, a
function's output sent back with ``previous_response_id``, the store, and ``text.format``."""

from __future__ import annotations

import json

import httpx
import pytest
from scripted_model import ANSWERING, CALLING, SCRIPTS, THINKING_ANSWER, start_scripted_server

openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    running = start_scripted_server(tiny_model_dir, tmp_path_factory, ["--reasoning-parser", "qwen3"])
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def respond(client, seed, **extra):
    """A scripted answer: the seed (an extra field, as vLLM takes it) picks the script."""
    return client.responses.create(model="any", input=extra.pop("input", QUESTION), tools=[WEATHER],
                                   temperature=0, max_output_tokens=120, extra_body={"seed": seed}, **extra)


def test_a_text_answer_is_one_message_item(client):
    response = respond(client, ANSWERING)
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text == SCRIPTS[ANSWERING] and response.status == "completed"
    assert response.id.startswith("resp_") and response.usage.input_tokens > 0
    assert response.usage.output_tokens_details.reasoning_tokens == 0


def test_a_call_is_a_function_call_item_after_the_reasoning_and_the_text(client):
    response = respond(client, CALLING)
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = response.output
    assert reasoning.content[0].text == "\nThe user asks about Paris.\n" and response.output_text == "Let me check."
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris", "unit": "celsius"})
    assert call.call_id.startswith("call_") and response.usage.output_tokens_details.reasoning_tokens > 0


def test_the_stream_adds_up_to_the_same_response(client):
    whole = respond(client, CALLING)
    with client.responses.stream(model="any", input=QUESTION, tools=[WEATHER], temperature=0, max_output_tokens=120,
                                 extra_body={"seed": CALLING}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.function_call_arguments.delta" in kinds
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 3
    assert [item.type for item in final.output] == [item.type for item in whole.output]
    assert final.output_text == whole.output_text and final.output[2].arguments == whole.output[2].arguments


def test_a_functions_output_continues_the_stored_conversation(client, server):
    first = respond(client, CALLING)
    call = first.output[-1]
    second = respond(client, THINKING_ANSWER, previous_response_id=first.id,
                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    assert second.output_text == "It is sunny in Paris." and second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens, "the first turn is in the prompt"
    assert client.responses.retrieve(second.id).output_text == "It is sunny in Paris."
    unknown = httpx.post(f"{server.url}/v1/responses", json={"input": "hi", "previous_response_id": "resp_nope"})
    assert unknown.status_code == 404 and unknown.json()["error_type"] == "not_found"


def test_store_false_keeps_nothing_and_instructions_are_this_turns_only(client, server):
    response = respond(client, ANSWERING, store=False, instructions="Answer in French.")
    assert httpx.get(f"{server.url}/v1/responses/{response.id}").status_code == 404
    assert response.instructions == "Answer in French."


def test_max_output_tokens_makes_an_incomplete_response(client):
    response = client.responses.create(model="any", input=QUESTION, max_output_tokens=3, temperature=0)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3


def test_text_format_json_schema_holds_the_output_to_the_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    response = client.responses.create(model="any", input=QUESTION, temperature=0, max_output_tokens=60,
                                       text={"format": {"type": "json_schema", "name": "place", "schema": schema}},
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert response.status == "completed", "at most 12 characters of city leave room to close the object"
    assert set(json.loads(response.output_text)) == {"city"}


@pytest.mark.parametrize("body, message", [
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "takes no images"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]},
     "only text parts and input_image"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "needs `call_id`"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({}, "input"),
])
def test_a_bad_request_is_a_422_that_names_the_field(server, body, message):
    response = httpx.post(f"{server.url}/v1/responses", json={"model": "any", **body})
    assert response.status_code == 422, response.text
    assert response.json()["error_type"] == "validation" and message in response.json()["error"]
