"""The chat route as a drop-in for OpenAI's and vLLM's: tool calls streamed as incremental deltas,
parallel tool calls, ``chat_template_kwargs`` and the operator's chat template (``--chat-template``,
``--tokenizer-config-path``), against real servers on the tiny model with the official client."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from conftest import launch_server, start_server
from openai.lib.streaming.chat import ChatCompletionStreamState

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
                   "additionalProperties": False}}}
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_END = {"2": -100}
"""``logit_bias`` against the tiny model's end token (<|im_end|>, id 2): where the grammar lets the
output go on, it must (another call), and where the grammar only allows the end, it still ends."""


@pytest.fixture(scope="module")
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def streamed_calls(chunks) -> tuple[list[tuple[str, str]], list]:
    """The (name, arguments) of each call rebuilt from the stream's deltas, and the deltas."""
    deltas = [tc for chunk in chunks if chunk.choices for tc in chunk.choices[0].delta.tool_calls or []]
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        if delta.index not in calls:  # a call's first delta: OpenAI's id, type and name, no arguments yet
            assert delta.index == len(calls), "calls open one after another"
            assert delta.id.startswith("call_") and delta.type == "function" and delta.function.arguments == ""
            calls[delta.index] = [delta.function.name, ""]
        else:  # then only pieces of the arguments
            assert delta.id is None and delta.function.name is None and delta.function.arguments
            calls[delta.index][1] += delta.function.arguments
    return [(name, arguments) for name, arguments in calls.values()], deltas


def whole_calls(choice) -> list[tuple[str, str]]:
    return [(call.function.name, call.function.arguments) for call in choice.message.tool_calls or []]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_streamed_tool_call_comes_in_pieces_that_rebuild_the_whole_answers_call(client, tool_choice):
    request = {"model": "any", "messages": QUESTION, "max_tokens": 60, "temperature": 0, "tools": [WEATHER, TIME],
               "tool_choice": tool_choice, "parallel_tool_calls": False}
    whole = client.chat.completions.create(**request).choices[0]
    ((name, arguments),) = whole_calls(whole)
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    chunks = list(client.chat.completions.create(**request, stream=True))
    calls, deltas = streamed_calls(chunks)
    assert calls == [(name, arguments)]
    assert len(deltas) > 3, "the arguments came as they were generated, not in one piece"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    with client.chat.completions.stream(**request) as stream:  # the client's own accumulation
        final = stream.get_final_completion().choices[0]
    assert whole_calls(final) == [(name, arguments)] and final.finish_reason == "tool_calls"


def test_parallel_tool_calls_are_several_calls_with_their_own_ids_and_indexes(client):
    request = {"model": "any", "messages": QUESTION, "max_tokens": 70, "temperature": 0, "tools": [WEATHER, TIME],
               "tool_choice": "required", "logit_bias": NO_END, "parallel_tool_calls": True}
    whole = client.chat.completions.create(**request).choices[0]
    calls = whole_calls(whole)
    assert len(calls) >= 2, "with no end allowed, the grammar's only way on is another call"
    assert len({call.id for call in whole.message.tool_calls}) == len(calls)
    cut = whole.finish_reason == "length"
    for name, arguments in calls[:-1] if cut else calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    assert whole.finish_reason in ("tool_calls", "length")
    chunks = list(client.chat.completions.create(**request, stream=True))
    streamed, deltas = streamed_calls(chunks)
    assert streamed == calls and chunks[-1].choices[0].finish_reason == whole.finish_reason
    assert len({delta.id for delta in deltas if delta.id}) == len(calls)
    state = ChatCompletionStreamState()  # the client's accumulation (its stream() refuses a "length" ending)
    for chunk in chunks:
        state.handle_chunk(chunk)
    assert whole_calls(state.current_completion_snapshot.choices[0]) == calls

    single = client.chat.completions.create(**{**request, "parallel_tool_calls": False}).choices[0]
    ((name, arguments),) = whole_calls(single)  # one call, whatever the bias says
    assert single.finish_reason == "tool_calls"
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    by_default = client.chat.completions.create(**{k: v for k, v in request.items() if k != "parallel_tool_calls"})
    assert whole_calls(by_default.choices[0]) == calls, "parallel calls are OpenAI's and vLLM's default"


@pytest.mark.parametrize("value, message", [
    (["enable_thinking"], "`chat_template_kwargs` must be an object"),
    ({"tokenize": True}, "may not set tokenize"),
    ({"add_generation_prompt": False, "messages": []}, "may not set add_generation_prompt, messages"),
])
def test_chat_template_kwargs_that_are_not_template_variables_are_a_422(tiny_server, value, message):
    with tiny_server.client() as http:
        response = http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 1,
                                                           "chat_template_kwargs": value})
    assert response.status_code == 422 and response.json()["error_type"] == "validation"
    assert message in response.json()["error"]


def test_parallel_tool_calls_must_be_a_boolean(tiny_server):
    with tiny_server.client() as http:
        response = http.post("/v1/chat/completions", json={"messages": QUESTION, "parallel_tool_calls": "yes"})
    assert response.status_code == 422 and "`parallel_tool_calls`" in response.json()["error"]


SHOUTING = ("{% if shout %}LOUD LOUD LOUD {% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
            "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def prompt_tokens(tokenizer, template: str, **variables) -> int:
    text = tokenizer.apply_chat_template(QUESTION, chat_template=template, add_generation_prompt=True,
                                         tokenize=False, **variables)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def served(tiny_model_dir, tmp_path, *flags: str):
    return start_server(["--model-id", str(tiny_model_dir), "--server", "uvicorn", "--max-total-tokens", "512",
                         "--backend", "transformers", *flags], tmp_path)


def test_chat_template_file_renders_the_chat_and_its_kwargs_reach_it(tiny_model_dir, tiny_model, tmp_path):
    template_file = tmp_path / "shouting.jinja"
    template_file.write_text(SHOUTING)
    server = served(tiny_model_dir, tmp_path, "--chat-template", str(template_file))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        plain = client.chat.completions.create(model="any", messages=QUESTION, max_tokens=1)
        loud = client.chat.completions.create(model="any", messages=QUESTION, max_tokens=1,
                                              extra_body={"chat_template_kwargs": {"shout": True}})
    finally:
        server.stop()
    tokenizer = tiny_model[1]
    assert plain.usage.prompt_tokens == prompt_tokens(tokenizer, SHOUTING)
    assert loud.usage.prompt_tokens == prompt_tokens(tokenizer, SHOUTING, shout=True)
    assert loud.usage.prompt_tokens > plain.usage.prompt_tokens
    assert plain.usage.prompt_tokens != prompt_tokens(tokenizer, tokenizer.chat_template)  # not the model's own


@pytest.mark.slow
def test_tokenizer_config_path_replaces_the_models_chat_template(tiny_model_dir, tiny_model, tmp_path):
    template = "Q: {{ messages[-1].content }}\nA:"
    config_file = tmp_path / "tokenizer_config.json"
    config_file.write_text(json.dumps({"chat_template": [{"name": "default", "template": template}]}))
    server = served(tiny_model_dir, tmp_path, "--tokenizer-config-path", str(config_file))
    try:
        with server.client() as http:
            reply = http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 1}).json()
    finally:
        server.stop()
    assert reply["usage"]["prompt_tokens"] == prompt_tokens(tiny_model[1], template)


@pytest.mark.parametrize("flag, line", [  # the other ways a template cannot be read: test_chat.py
    ("--chat-template", "--chat-template: the Jinja template does not compile: unexpected '}' (line 1)"),
    ("--tokenizer-config-path", "/no/such/tokenizer_config.json: no such file"),
])
def test_a_chat_template_that_cannot_be_used_stops_the_start_with_one_line(tiny_model_dir, tmp_path, flag, line):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }")
    value = str(broken) if flag == "--chat-template" else "/no/such/tokenizer_config.json"
    server = launch_server(["--model-id", str(tiny_model_dir), "--server", "uvicorn", flag, value], tmp_path)
    try:
        server.process.wait(120)
    finally:
        server.stop()
    log = server.log()
    assert server.process.returncode != 0
    (failure,) = [entry for entry in log.splitlines() if "startup failed" in entry]
    assert line in failure and "Traceback" not in log
    assert "load stage loading weights" not in log, "it fails before the weights load"
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{server.url}/health", timeout=1)
