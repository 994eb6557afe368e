"""Structured output, tool calls and the watermark on the real default model (SmolLM2), through the `openai` client."""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from conftest import RunningServer, start_server

from tokenmill.sampling.watermark import detect_text

pytestmark = pytest.mark.slow

BOOK = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
        "genres": {"type": "array", "items": {"enum": ["fiction", "history", "science", "poetry"]},
                   "maxItems": 3},
    },
    "required": ["title", "year", "genres"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TOPICS = ["a dragon who learns to bake", "how rain forms", "your favourite city", "the history of bread",
          "what makes a good friend", "the ocean at night", "a robot gardener", "learning to swim",
          "the first day of school", "a mountain village"]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = start_server(["--server", "uvicorn", "--max-total-tokens", "1024"], tmp_path_factory.mktemp("smollm2"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(smollm2: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{smollm2.url}/v1", api_key="unused", max_retries=0, timeout=300)


def ask(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def test_chat_answers_for_real(client):
    reply = client.chat.completions.create(model="smollm2", messages=ask("What is the capital of France?"),
                                           max_tokens=30, temperature=0)
    assert "Paris" in reply.choices[0].message.content and reply.choices[0].finish_reason == "stop"


def test_json_schema_output_validates_for_every_prompt(client):
    def one(topic: str) -> str:
        reply = client.chat.completions.create(
            model="smollm2", messages=ask(f"Describe a book about {topic} as JSON."), max_tokens=120, temperature=0.7,
            seed=1, response_format={"type": "json_schema", "json_schema": {"name": "book", "schema": BOOK}})
        assert reply.choices[0].finish_reason == "stop"
        return reply.choices[0].message.content

    with ThreadPoolExecutor(8) as pool:
        for text in pool.map(one, TOPICS[:6]):
            jsonschema.validate(json.loads(text), BOOK)


def test_json_object_output_parses(client):
    reply = client.chat.completions.create(model="smollm2", messages=ask("List three fruits as a JSON object."),
                                           max_tokens=150, temperature=0, response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_tool_call_arguments_validate_against_the_tool(client):
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        reply = client.chat.completions.create(model="smollm2", messages=ask("What's the weather like in Paris?"),
                                               max_tokens=60, temperature=0, tools=[WEATHER], tool_choice=tool_choice,
                                               parallel_tool_calls=False)
        (call,) = reply.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and reply.choices[0].finish_reason == "tool_calls"
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, WEATHER["function"]["parameters"])
        assert "Paris" in arguments["city"]


def test_a_question_about_two_cities_gets_parallel_calls_for_both(client):
    question = ask("What's the weather like in Paris and in Rome?")
    reply = client.chat.completions.create(model="smollm2", messages=question, max_tokens=100, temperature=0,
                                           tools=[WEATHER], tool_choice="required", parallel_tool_calls=True)
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and len({call.id for call in calls}) == len(calls)
    assert {json.loads(call.function.arguments)["city"] for call in calls} == {"Paris", "Rome"}


def test_regex_grammar_through_generate(smollm2):
    pattern = r"\(\d{3}\) \d{3}-\d{4}"
    with smollm2.client() as http:
        text = http.post("/generate", json={"inputs": "Call me at", "parameters": {
            "max_new_tokens": 20, "grammar": {"type": "regex", "value": pattern}}}).json()["generated_text"]
    assert re.fullmatch(pattern, text), text


def test_watermarked_generations_are_detected_and_plain_ones_are_not(client):
    from transformers import AutoTokenizer

    from tokenmill.model.loading import DEFAULT_MODEL_FILE, default_gguf

    gguf = default_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=DEFAULT_MODEL_FILE)

    def z(job: tuple[str, int, bool]) -> float:
        topic, seed, watermark = job
        messages = ask(f"Write a few sentences about {topic}.")
        reply = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=100, seed=seed,
                                               extra_body={"watermark": watermark})
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return detect_text(reply.choices[0].message.content, tokenizer, 49152, 0.5, prompt=prompt).z_score

    jobs = [(topic, seed, mark) for mark in (True, False) for seed in (1, 2) for topic in TOPICS]
    with ThreadPoolExecutor(20) as pool:
        scores = list(pool.map(z, jobs))
    marked, plain = scores[:20], scores[20:]
    assert statistics.mean(marked) > 4, marked
    assert statistics.mean(abs(s) for s in plain) < 2 and max(abs(s) for s in plain) < 4, plain
