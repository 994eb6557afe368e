"""OpenAI's API, spoken by the official `openai` client, against the real server on the tiny model."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "member": {"type": "boolean"},
        "colour": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "member", "colour"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def rendered(tiny_model, messages) -> str:
    return tiny_model[1].apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_models_lists_the_served_model(client, tiny_model_dir):
    models = client.models.list().data
    assert [m.id for m in models] == [str(tiny_model_dir)]


def test_chat_completion_is_the_greedy_generation_of_the_chat_template(client, tiny_server, tiny_model):
    reply = client.chat.completions.create(model="any", messages=QUESTION, max_tokens=12, temperature=0)
    prompt = rendered(tiny_model, QUESTION)
    with tiny_server.client() as http:
        expected = http.post("/generate", json={"inputs": prompt, "parameters": {
            "max_new_tokens": 12, "details": True}}).json()
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected["generated_text"]
    assert choice.finish_reason == "length"
    prompt_tokens = len(tiny_model[1](prompt, add_special_tokens=False)["input_ids"])
    assert reply.usage.prompt_tokens == prompt_tokens
    assert reply.usage.completion_tokens == 12 == expected["details"]["generated_tokens"]
    assert reply.usage.total_tokens == prompt_tokens + 12
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")


def test_streamed_chat_adds_up_to_the_whole_answer_and_ends_with_usage_and_done(client, tiny_server):
    whole = client.chat.completions.create(model="any", messages=QUESTION, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model="any", messages=QUESTION, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])
    with httpx.stream("POST", f"{tiny_server.url}/v1/chat/completions", timeout=60, json={
            "messages": QUESTION, "max_tokens": 3, "stream": True}) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"


def test_n_choices_are_separate_sequences_and_seeded_choices_repeat(client):
    first = client.chat.completions.create(model="any", messages=QUESTION, max_tokens=8, n=3, seed=7)
    again = client.chat.completions.create(model="any", messages=QUESTION, max_tokens=8, n=3, seed=7)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert len({c.message.content for c in first.choices}) > 1
    assert first.usage.completion_tokens == 24
    single = client.chat.completions.create(model="any", messages=QUESTION, max_tokens=1)
    assert first.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once, as OpenAI counts it
    streamed = list(client.chat.completions.create(model="any", messages=QUESTION, max_tokens=8, n=3, seed=7,
                                                   stream=True))
    texts = ["".join(c.choices[0].delta.content or "" for c in streamed if c.choices and c.choices[0].index == i)
             for i in range(3)]
    assert texts == [c.message.content for c in first.choices]


def test_temperature_zero_is_greedy_whatever_top_p_and_top_k_say(client):
    greedy = client.chat.completions.create(model="any", messages=QUESTION, max_tokens=8, temperature=0)
    truncated = client.chat.completions.create(model="any", messages=QUESTION, max_tokens=8, temperature=0,
                                               top_p=0.5, extra_body={"top_k": 3})
    assert truncated.choices[0].message.content == greedy.choices[0].message.content


def test_n_above_the_client_batch_limit_is_refused_naming_n(client):
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        client.chat.completions.create(model="any", messages=QUESTION, max_tokens=2, n=5)
    assert "`n`" in refused.value.body  # TGI's error body: the client keeps its `error` string as `body`


def test_logprobs_come_with_the_requested_top_alternatives(client):
    reply = client.chat.completions.create(model="any", messages=QUESTION, max_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert "".join(entry.token for entry in content) == reply.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the likeliest
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.bytes == list(entry.token.encode())


def test_stop_sequences_end_the_answer_and_are_left_out(client):
    free = client.chat.completions.create(model="any", messages=QUESTION, max_tokens=20, temperature=0)
    text = free.choices[0].message.content
    stop = text[5:8]
    reply = client.chat.completions.create(model="any", messages=QUESTION, max_tokens=20, temperature=0, stop=stop)
    assert reply.choices[0].message.content == text[: text.index(stop)]
    assert reply.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model="any", messages=QUESTION, max_tokens=20, temperature=0,
                                              stop=[stop], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text[: text.index(stop)]


def test_json_schema_response_format_always_parses_and_validates(client):
    for seed in range(3):
        reply = client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "A person, as JSON."}], max_tokens=60, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)


def test_json_object_response_format_opens_an_object(client):
    # A random model may write an endless string inside it; SmolLM2's finish is tested in test_openai_smollm2.py.
    reply = client.chat.completions.create(model="any", messages=QUESTION, max_tokens=3, temperature=0,
                                           response_format={"type": "json_object"})
    assert reply.choices[0].message.content.startswith("{")


def test_required_tool_choice_returns_a_call_whose_arguments_fit_the_tool(client):
    for seed in range(3):
        reply = client.chat.completions.create(model="any", messages=QUESTION, max_tokens=60, seed=seed,
                                               tools=[WEATHER, TIME], tool_choice="required",
                                               parallel_tool_calls=False)  # several: test_chat_dropin.py
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        assert call.type == "function" and call.id.startswith("call_")


def test_a_named_tool_choice_calls_that_tool_and_streams_the_call_in_pieces(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    reply = client.chat.completions.create(model="any", messages=QUESTION, max_tokens=40, temperature=0,
                                           tools=[WEATHER, TIME], tool_choice=named, parallel_tool_calls=False)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    chunks = list(client.chat.completions.create(model="any", messages=QUESTION, max_tokens=40, temperature=0,
                                                 tools=[WEATHER, TIME], tool_choice=named, stream=True,
                                                 parallel_tool_calls=False))
    first, *rest = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert (first.function.name, first.function.arguments) == ("get_time", "")  # then the arguments, in pieces
    assert "".join(tc.function.arguments for tc in rest) == call.function.arguments and len(rest) > 1
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_tool_choice_answers_in_text_or_with_a_valid_call_and_none_never_calls(client):
    for seed in range(4):
        choice = client.chat.completions.create(model="any", messages=QUESTION, max_tokens=30, seed=seed,
                                                tools=[WEATHER]).choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments),
                                WEATHER["function"]["parameters"])
        else:
            assert not choice.message.content.lstrip().startswith("{")
    choice = client.chat.completions.create(model="any", messages=QUESTION, max_tokens=10, temperature=0,
                                            tools=[WEATHER], tool_choice="none").choices[0]
    assert not choice.message.tool_calls and choice.finish_reason == "length"


def test_a_conversation_with_a_tool_result_goes_on(client):
    history = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]
    reply = client.chat.completions.create(model="any", messages=history, max_tokens=5, temperature=0)
    assert reply.usage.prompt_tokens > 30 and reply.choices[0].message.content


def test_completions_take_a_list_of_prompts_with_n_each_and_echo(client, tiny_server):
    prompts = ["The capital of France is", "def add(a, b):"]
    reply = client.completions.create(model="any", prompt=prompts, max_tokens=5, temperature=0, n=2, logprobs=2)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    with tiny_server.client() as http:
        expected = [http.post("/generate", json={"inputs": p, "parameters": {"max_new_tokens": 5}}).json()
                    ["generated_text"] for p in prompts]
    assert [c.text for c in reply.choices] == [expected[0], expected[0], expected[1], expected[1]]
    for choice in reply.choices:
        assert "".join(choice.logprobs.tokens) == choice.text and len(choice.logprobs.token_logprobs) == 5
        assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)
    echoed = client.completions.create(model="any", prompt=prompts[0], max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == prompts[0] + expected[0]
    streamed = client.completions.create(model="any", prompt=prompts[0], max_tokens=5, temperature=0, echo=True,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == prompts[0] + expected[0]
    assert reply.object == "text_completion" and reply.usage.completion_tokens == 20


def test_completions_default_to_16_tokens_and_stream(client):
    whole = client.completions.create(model="any", prompt="Once upon a time", temperature=0)
    assert whole.usage.completion_tokens == 16
    chunks = list(client.completions.create(model="any", prompt="Once upon a time", temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


@pytest.mark.parametrize("field, value", [
    ("temperature", "hot"), ("max_tokens", "ten"), ("messages", "hello"), ("stop", 3), ("n", 1.5),
    ("top_logprobs", 3), ("response_format", "json"), ("tools", {"name": "x"}), ("stream", "yes"),
    ("tool_choice", {"type": "function", "function": "get_weather"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]),
    # Found by .ci/fuzz (TGI's spec, and OpenAI, type or require each of these):
    ("response_format", {"json_schema": {"name": "x", "schema": {}}}),  # no `type`: not read as "text"
    ("response_format", {"type": "json_schema", "json_schema": {"name": {}, "schema": {}}}),
    ("response_format", {"type": "regex", "value": 3}), ("model", {}), ("tool_prompt", {}), ("logit_bias", "x"),
    ("seed", 2**64), ("seed", -(2**63) - 1),
    ("tools", [{"function": {"name": "f"}}]),  # no `type`
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": False}}]),
    ("tools", [{"type": "function", "function": {"name": "f", "description": {}}}]),
    ("messages", [{"role": "user", "name": 5, "content": "Hi"}]), ("messages", [{"role": "user"}]),
    ("messages", [*QUESTION, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]),
])
def test_a_field_of_the_wrong_type_is_a_422_that_names_it(tiny_server, field, value):
    body = {"messages": QUESTION, "max_tokens": 2, field: value}
    if field == "tool_choice":
        body["tools"] = [WEATHER]
    with tiny_server.client() as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["error_type"] == "validation" and f"`{field}" in response.json()["error"]


def test_a_completion_suffix_of_the_wrong_type_is_a_422(tiny_server):
    with tiny_server.client() as http:
        response = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "suffix": {}})
    assert response.status_code == 422 and "`suffix`" in response.json()["error"], response.text


def test_tgi_forms_of_response_format_tools_and_logit_bias_are_taken(client):
    """TGI's spec documents `response_format` as its `grammar` parameter, a tool's parameters as
    `arguments`, and `logit_bias` as a list; OpenAI's map of `logit_bias` and negative seeds are taken too."""
    text = client.chat.completions.create(model="any", messages=QUESTION, max_tokens=60, seed=1,
                                          response_format={"type": "json", "value": PERSON}).choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    reply = client.chat.completions.create(model="any", messages=QUESTION, max_tokens=10, seed=-5,
                                           response_format={"type": "regex", "value": "[0-9]{3}"})
    assert re.fullmatch("[0-9]{3}", reply.choices[0].message.content)
    named = {"type": "json_schema", "value": {"name": "person", "schema": PERSON}}
    text = client.chat.completions.create(model="any", messages=QUESTION, max_tokens=60, seed=2,
                                          response_format=named).choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    as_arguments = {"type": "function", "function": {"name": "get_weather",
                                                     "arguments": WEATHER["function"]["parameters"]}}
    (call,) = client.chat.completions.create(model="any", messages=QUESTION, max_tokens=60, temperature=0,
                                             tools=[as_arguments], tool_choice="required",
                                             parallel_tool_calls=False).choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    for bias in ({"42": -100}, [0.5]):
        assert client.chat.completions.create(model="any", messages=QUESTION, max_tokens=2,
                                              logit_bias=bias).usage.completion_tokens == 2


def test_unknown_fields_are_ignored(client):
    reply = client.chat.completions.create(model="any", messages=QUESTION, max_tokens=2, user="me",
                                           extra_body={"some_future_field": {"x": 1}, "metadata": {"a": "b"}})
    assert reply.usage.completion_tokens == 2


def test_generate_follows_a_regex_grammar_and_refuses_a_broken_one(tiny_server):
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    with tiny_server.client() as http:
        for seed in range(3):
            body = http.post("/generate", json={"inputs": "Code:", "parameters": {
                "max_new_tokens": 20, "do_sample": True, "seed": seed,
                "grammar": {"type": "regex", "value": pattern}, "details": True}}).json()
            assert re.fullmatch(pattern, body["generated_text"]), body
            assert body["details"]["finish_reason"] == "eos_token"
        broken = http.post("/generate", json={"inputs": "x", "parameters": {
            "grammar": {"type": "regex", "value": "([0-9]"}}})
        bad_schema = http.post("/generate", json={"inputs": "x", "parameters": {
            "grammar": {"type": "json", "value": {"type": "nonsense"}}}})
        bad_type = http.post("/generate", json={"inputs": "x", "parameters": {
            "grammar": {"type": "xml", "value": "<a/>"}}})
    for response in (broken, bad_schema, bad_type):
        assert response.status_code == 422 and response.json()["error_type"] == "validation", response.text
    assert "regex" in broken.json()["error"] and "nonsense" in bad_schema.json()["error"]


def test_generate_json_grammars_by_schema_and_by_named_schema(tiny_server):
    with tiny_server.client() as http:
        for grammar in ({"type": "json", "value": PERSON}, {"type": "json", "value": json.dumps(PERSON)},
                        {"type": "json_schema", "value": {"name": "person", "schema": PERSON}}):
            text = http.post("/generate", json={"inputs": "Person:", "parameters": {
                "max_new_tokens": 60, "grammar": grammar}}).json()["generated_text"]
            jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("extra_body, holds", [
    ({"structured_outputs": {"choice": ["yes", "no (maybe)"]}}, lambda text: text in ("yes", "no (maybe)")),
    ({"guided_choice": ["red.", "green*"]}, lambda text: text in ("red.", "green*")),
    ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, lambda text: re.fullmatch("[0-9]{3}-[a-z]{2}", text)),
    ({"guided_regex": "(ab)+c"}, lambda text: re.fullmatch("(ab)+c", text)),
    ({"structured_outputs": {"json": PERSON}}, lambda text: jsonschema.validate(json.loads(text), PERSON) is None),
    ({"guided_json": json.dumps(PERSON)}, lambda text: jsonschema.validate(json.loads(text), PERSON) is None),
    ({"structured_outputs": {"grammar": 'start: "A" ("B" | "C")+ "."'}}, lambda text: re.fullmatch("A[BC]+\\.", text)),
    ({"guided_grammar": 'start: "x" | "y"'}, lambda text: text in ("x", "y")),
])
def test_vllms_structured_outputs_and_guided_fields_constrain_the_output(client, extra_body, holds):
    for seed in range(2):
        chat = client.chat.completions.create(model="any", messages=QUESTION, max_tokens=60, seed=seed,
                                              extra_body=extra_body).choices[0]
        completion = client.completions.create(model="any", prompt="Answer:", max_tokens=60, seed=seed,
                                               extra_body=extra_body).choices[0]
        for text, reason in ((chat.message.content, chat.finish_reason), (completion.text, completion.finish_reason)):
            assert reason == "stop" and holds(text), text


def test_a_json_object_constraint_leaves_no_room_for_padding_whitespace(tiny_server):
    """Compact JSON only: a model that likes spaces cannot fill its tokens with them."""
    with tiny_server.client() as http:
        answer = http.post("/v1/completions", json={"prompt": "{", "max_tokens": 40, "temperature": 0,
                                                    "structured_outputs": {"json_object": True},
                                                    "logit_bias": {str(i): 100 for i in space_tokens(http)}})
    text = answer.json()["choices"][0]["text"]
    assert answer.status_code == 200 and text.startswith("{") and not re.search(r"[{\[,:]\s\s", text), text


def space_tokens(http: httpx.Client) -> list[int]:
    """Token ids that are nothing but whitespace."""
    ids = [token["id"] for token in http.post("/tokenize", json={"inputs": "   \n\n  \t"}).json()]
    return sorted(set(ids))


@pytest.mark.parametrize("extra, named", [
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.regex"),
    ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}}, "guided_json"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "("}, "guided_regex"),
    ({"structured_outputs": {"grammar": "start: nonsense_rule"}}, "structured_outputs.grammar"),
    ({"guided_json": {"type": "object"}, "tools": [WEATHER]}, "guided_json"),
])
def test_a_structured_output_that_cannot_be_applied_is_a_422_naming_it(tiny_server, extra, named):
    with tiny_server.client() as http:
        response = http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 2, **extra})
    assert response.status_code == 422, response.text
    assert f"`{named}" in response.json()["error"], response.text
