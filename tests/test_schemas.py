"""The typed request and response shapes (core/tokenmill/http/schemas) and the OpenAPI document built from them.

Three kinds of check: the models against TGI's own spec (its examples are accepted, what its serde
refuses is refused); the served document against OpenAPI 3.1 and against the app's router (every
route listed, nothing listed that is not served); and the document against what a real server on the
tiny model answers (each response body validates against the schema the document gives it)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import schemathesis
from openapi_spec_validator import validate as validate_openapi

from tokenmill.config import parse_config
from tokenmill.http.app import create_app
from tokenmill.http.openai.convert import to_generate
from tokenmill.http.openai.schemas import ChatRequest, CompletionRequest
from tokenmill.http.openapi import served_operations, undocumented
from tokenmill.http.schemas import ValidationError, check_body
from tokenmill.http.tgi.schemas import CompatGenerateRequest, GenerateParameters, GenerateRequest
from tokenmill.plugin_manager import build_plugin_manager

TGI_SPEC = json.loads((Path(__file__).resolve().parent.parent / ".ci" / "tgi-openapi.json").read_text())
QUESTION = [{"role": "user", "content": "What is Deep Learning?"}]


# --- the models, against TGI's spec ----------------------------------------------------------------


def spec_examples(schema_name: str) -> dict[str, Any]:
    """The examples TGI's spec gives for the properties of ``schema_name`` that are valid by the
    spec's own property schema (some are written as strings: ``"20"``, ``"null"``; those are read as
    JSON first, and left out when they still do not fit)."""
    properties = TGI_SPEC["components"]["schemas"][schema_name]["properties"]
    examples = {}
    for name, prop in properties.items():
        if "example" not in prop or "type" not in prop:
            continue
        schema = {key: value for key, value in prop.items() if key in ("type", "items", "enum")}
        schema["components"] = TGI_SPEC["components"]
        for candidate in (prop["example"], _as_json(prop["example"])):
            if candidate is not None and jsonschema.Draft202012Validator(schema).is_valid(candidate):
                examples[name] = candidate
                break
    return examples


def _as_json(value: Any) -> Any:
    try:
        return json.loads(value) if isinstance(value, str) else None
    except ValueError:
        return None


def test_the_models_take_tgi_spec_examples():
    parameters = spec_examples("GenerateParameters")
    assert {"best_of", "do_sample", "max_new_tokens", "stop", "temperature", "top_k", "top_p"} <= set(parameters)
    inputs = spec_examples("GenerateRequest")["inputs"]
    body = check_body(GenerateRequest, {"inputs": inputs, "parameters": parameters})
    assert body.parameters.max_new_tokens == 20 and body.parameters.stop == ["photographer"]
    assert check_body(CompatGenerateRequest, {"inputs": inputs, "parameters": parameters, "stream": True}).stream
    chat = spec_examples("ChatRequest")
    assert chat["messages"] == QUESTION and "top_logprobs" in chat
    assert check_body(ChatRequest, chat).messages[0].role == "user"
    completion = {"prompt": ["My name is Olivier and I"], **spec_examples("CompletionRequest")}
    assert check_body(CompletionRequest, completion).max_tokens == 32
    grammar = {"type": "json_schema", "value": {"name": "p", "schema": {"type": "object"}}}
    assert check_body(GenerateRequest, {"inputs": "x", "parameters": {"grammar": grammar}}).parameters.grammar


@pytest.mark.parametrize("model, body", [
    (GenerateRequest, {"inputs": "x", "parameters": {"top_k": 2.0, "future_parameter": [1]}, "unknown": 1}),
    (ChatRequest, {"messages": QUESTION, "logit_bias": [0.5], "seed": -5, "stop": "x", "tool_choice": "auto"}),
    (ChatRequest, {"messages": QUESTION, "logit_bias": {"42": -100}, "chat_template_kwargs": {"a": 1},
                   "parallel_tool_calls": False, "min_p": 0.1, "stop_token_ids": [2]}),
    (CompletionRequest, {"prompt": "x", "echo": True, "min_tokens": 1, "ignore_eos": True}),
    (CompletionRequest, {"prompt": [1, 2, 3]}),
    (CompletionRequest, {"prompt": [[1, 2], [3]], "max_tokens": 0}),
])
def test_what_tokenmill_takes_beyond_tgi_is_taken(model, body):
    """Unknown fields are kept for the handlers (TGI's serde ignores them); OpenAI's and vLLM's forms pass."""
    checked = check_body(model, body)
    if model is GenerateRequest:
        assert checked.unknown == 1 and checked.parameters.future_parameter == [1]
        assert checked.parameters.top_k == 2


@pytest.mark.parametrize("model, body, message", [
    (GenerateRequest, {"inputs": "x", "parameters": None}, "`parameters` must be an object, not null"),
    (GenerateRequest, {"inputs": "x", "parameters": "fast"}, "`parameters` must be an object, got 'fast'"),
    (GenerateRequest, {"parameters": {}}, "missing field `inputs`"),
    (GenerateRequest, {"inputs": 42}, "`inputs` must be a string, got 42"),
    (GenerateRequest, {"inputs": "x", "parameters": {"temperature": "x"}}, "`temperature` must be a finite number"),
    (GenerateRequest, {"inputs": "x", "parameters": {"temperature": 0}}, "`temperature` must be strictly positive"),
    (GenerateRequest, {"inputs": "x", "parameters": {"top_p": 1.0}}, "`top_p` must be > 0.0 and < 1.0, got 1.0"),
    (GenerateRequest, {"inputs": "x", "parameters": {"seed": 2**64}}, "`seed` must be >= 0 and < 2^64"),
    (GenerateRequest, {"inputs": "x", "parameters": {"priority": "urgent"}}, "`priority` must be one of high, normal"),
    (GenerateRequest, {"inputs": "x", "parameters": {"cache_salt": ""}}, "`cache_salt` must be a string of at least"),
    (ChatRequest, {"messages": QUESTION, "temperature": 2.5}, "`temperature` must be >= 0.0 and <= 2.0, got 2.5"),
    (GenerateRequest, {"inputs": "x", "parameters": {"temperature": 10**400}}, "got an integer too large for one"),
    (GenerateRequest, {"inputs": "x", "parameters": {"top_k": 1.5}}, "`top_k` must be an integer, got 1.5"),
    (GenerateRequest, {"inputs": "x", "parameters": {"do_sample": 1}}, "`do_sample` must be a boolean, got 1"),
    (GenerateRequest, {"inputs": "x", "parameters": {"details": None}}, "`details` must be a boolean, not null"),
    (GenerateRequest, {"inputs": "x", "parameters": {"stop": ["a", 3]}}, "`stop[1]` must be a string"),
    (GenerateRequest, {"inputs": "x", "parameters": {"grammar": "json"}}, "`grammar` must be an object"),
    (GenerateRequest, {"inputs": "x", "parameters": {"grammar": {"type": "regex"}}}, "`grammar` must be an object"),
    (GenerateRequest, {"inputs": "x", "parameters": {"grammar": {"type": "xml", "value": ""}}},
     "`grammar.type` must be one of json, json_schema, regex, got 'xml'"),
    (GenerateRequest, {"inputs": "x", "parameters": {"stop_token_ids": [True]}}, "`stop_token_ids` must be a list"),
    (CompatGenerateRequest, {"inputs": "x", "stream": None}, "`stream` must be a boolean, not null"),
    (CompatGenerateRequest, {"inputs": "x", "stream": "false"}, "`stream` must be a boolean, got 'false'"),
    (GenerateRequest, ["inputs"], "the request body must be a JSON object"),
    (ChatRequest, {"messages": [{"role": "user", "name": 5, "content": "Hi"}]}, "`messages[0].name` must be a string"),
    (ChatRequest, {"messages": [{"content": "Hi"}]}, "missing field `messages[0].role`"),
    (ChatRequest, {"messages": QUESTION, "stream": None}, "`stream` must be a boolean, not null"),
    (ChatRequest, {"messages": QUESTION, "stream_options": {"include_usage": "yes"}},
     "`stream_options.include_usage` must be a boolean"),
    (ChatRequest, {"messages": QUESTION, "tools": [{"function": {"name": "f"}}]}, "missing field `tools[0].type`"),
    (ChatRequest, {"messages": QUESTION, "tool_choice": "sometimes"}, '`tool_choice` must be "none", "auto"'),
    (ChatRequest, {"messages": QUESTION, "logit_bias": {"1": "x"}}, "`logit_bias` must be an object of token ids"),
    (ChatRequest, {"messages": QUESTION, "chat_template_kwargs": []}, "`chat_template_kwargs` must be an object"),
    (CompletionRequest, {"prompt": [[1], "x"]}, "`prompt` must be a string, a list of strings, a list of token ids"),
    (CompletionRequest, {"prompt": None}, "`prompt` must be a string"),
    (CompletionRequest, {"prompt": "x", "echo": "yes"}, "`echo` must be a boolean"),
])
def test_what_tgi_refuses_is_a_validation_error_naming_the_field(model, body, message):
    with pytest.raises(ValidationError) as refused:
        check_body(model, body)
    assert message in str(refused.value)


# --- the document, against OpenAPI and the router --------------------------------------------------


def app_and_client(*flags: str) -> tuple[Any, httpx.AsyncClient]:
    """The real ASGI app (not started: no model is needed for the document) and a client for it."""
    app = create_app(parse_config(["--model-id", "never-loaded", *flags], env={}), build_plugin_manager(autoload=False))
    return app, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app")


def get_all(app_flags: tuple[str, ...], *paths: str, headers: dict[str, str] | None = None) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        async with app_and_client(*app_flags)[1] as client:
            return [await client.get(path, headers=headers) for path in paths]

    return asyncio.run(run())


def test_the_document_is_valid_openapi_and_schemathesis_loads_it():
    document, same, page = get_all((), "/api-doc/openapi.json", "/openapi.json", "/docs")
    assert document.status_code == 200 and document.headers["content-type"].startswith("application/json")
    spec = document.json()
    assert same.json() == spec and spec["openapi"].startswith("3.1")
    validate_openapi(spec)
    operations = [result.ok() for result in schemathesis.openapi.from_dict(spec).get_all_operations()]
    assert {(op.method.upper(), op.path) for op in operations} == {
        (method.upper(), path) for path, methods in spec["paths"].items() for method in methods}
    for name in ("GenerateRequest", "GenerateParameters", "StreamResponse", "ChatRequest", "ChatCompletionChunk",
                 "CompletionRequest", "Info", "ErrorResponse", "GrammarType", "TokenizeResponse"):
        assert name in spec["components"]["schemas"], name
    for path, methods in spec["paths"].items():
        assert "requestBody" not in methods.get("get", {}), path
    stream = spec["paths"]["/generate_stream"]["post"]["responses"]["200"]["content"]
    assert set(stream) == {"text/event-stream"}
    parameters = spec["components"]["schemas"]["GenerateParameters"]["properties"]
    assert parameters["details"]["type"] == "boolean" and "anyOf" not in parameters["details"], "not nullable"
    assert {"type": "null"} in parameters["temperature"]["anyOf"], "nullable, as TGI's Option"
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "./api-doc/openapi.json" in page.text and "swagger-ui-bundle.js" in page.text
    assert "could not load" in page.text and "<code>/v1/chat/completions</code>" in page.text


def test_the_document_lists_exactly_the_routes_the_app_serves():
    app, _ = app_and_client()
    served = set(served_operations(app.app))
    assert undocumented(app.app) == []
    assert {("POST", "/generate"), ("GET", "/docs"), ("POST", "/v1/completions"), ("GET", "/health")} <= served
    (document,) = get_all((), "/openapi.json")
    listed = {(method.upper(), path) for path, methods in document.json()["paths"].items() for method in methods}
    assert listed == served
    assert "/debug/profile" not in document.json()["paths"], "off unless --enable-profiling"
    (profiled,) = get_all(("--enable-profiling", "--api-key", "k"), "/openapi.json")
    assert "seconds" in json.dumps(profiled.json()["paths"]["/debug/profile"]["get"]["parameters"])


def test_a_route_the_table_lacks_is_listed_as_undocumented():
    app, client = app_and_client()

    class PluginRoute:
        async def on_get(self, req, resp) -> None:
            resp.media = {}

    app.app.add_route("/plugin/thing", PluginRoute())  # as a plugin's tokenmill_add_routes would

    async def run() -> dict:
        async with client:
            return (await client.get("/openapi.json")).json()

    assert undocumented(app.app) == [("GET", "/plugin/thing")]
    assert asyncio.run(run())["paths"]["/plugin/thing"]["get"]["summary"].startswith("Undocumented")


def test_the_document_and_its_viewer_need_no_api_key():
    flags = ("--api-key", "secret")
    document, legacy, page, generate = get_all(flags, "/api-doc/openapi.json", "/openapi.json", "/docs", "/queue")
    assert document.status_code == legacy.status_code == page.status_code == 200
    assert generate.status_code == 401
    spec = document.json()
    assert spec["components"]["securitySchemes"]["api_key"]["scheme"] == "bearer"
    assert spec["paths"]["/generate"]["post"]["security"] == [{"api_key": []}]
    assert "401" in spec["paths"]["/generate"]["post"]["responses"]
    assert "security" not in spec["paths"]["/health"]["get"]


# --- a real server: what TGI refuses, and its answers against the document -------------------------

ONE_BACKEND = pytest.mark.parametrize("tiny_server", ["transformers"], indirect=True)


@ONE_BACKEND
@pytest.mark.parametrize("path, body, named", [
    ("/generate", {"inputs": "Hi", "parameters": None}, "`parameters`"),
    ("/generate_stream", {"inputs": "Hi", "parameters": None}, "`parameters`"),
    ("/", {"inputs": "Hi", "stream": None}, "`stream`"),
    ("/", {"inputs": "Hi", "parameters": None, "stream": False}, "`parameters`"),
    ("/tokenize", {"inputs": "Hi", "parameters": {"max_new_tokens": "many"}}, "`max_new_tokens`"),
    ("/tokenize", {"inputs": "Hi", "parameters": None}, "`parameters`"),
    ("/tokenize", {"inputs": "Hi", "parameters": {"temperature": 0}}, "`temperature`"),
    ("/tokenize", {"inputs": "Hi", "parameters": {"grammar": {}}}, "`grammar`"),
    ("/tokenize", {"inputs": ["Hi"]}, "`inputs`"),
    ("/v1/chat/completions", {"messages": QUESTION, "stream": None}, "`stream`"),
    ("/v1/completions", {"prompt": "Hi", "stop_token_ids": 2}, "`stop_token_ids`"),
])
def test_what_tgi_refuses_is_422_over_http(tiny_server, path, body, named):
    with tiny_server.client() as client:
        response = client.post(path, json=body)
    assert response.status_code == 422, response.text
    assert response.json()["error_type"] == "validation" and named in response.json()["error"]


def conforms(document: dict[str, Any], schema: dict[str, Any], value: Any) -> None:
    """``value`` is valid by ``schema``, whose ``$ref`` values point into ``document``'s components."""
    jsonschema.Draft202012Validator({**schema, "components": document["components"]}).validate(value)


def answer_schema(document: dict[str, Any], method: str, path: str, media: str = "application/json") -> dict:
    content = document["paths"][path][method]["responses"]["200"]["content"][media]["schema"]
    return content["properties"]["data"]["contentSchema"] if media == "text/event-stream" else content


def stream_data(response: httpx.Response) -> list[Any]:
    return [json.loads(line[5:]) for line in response.iter_lines()
            if line.startswith("data:") and line[5:].strip() != "[DONE]"]


@ONE_BACKEND
def test_real_answers_conform_to_the_served_document(tiny_server):
    with tiny_server.client() as client:
        document = client.get("/openapi.json").json()
        assert client.get("/docs").status_code == 200

        def check(method: str, path: str, body: Any = None, media: str = "application/json") -> None:
            if media == "text/event-stream":
                with client.stream(method.upper(), path, json=body) as response:
                    events = stream_data(response)
                assert response.status_code == 200 and events
                for event in events:
                    conforms(document, answer_schema(document, method, path, media), event)
                return
            response = client.request(method.upper(), path, json=body)
            assert response.status_code == 200, response.text
            conforms(document, answer_schema(document, method, path), response.json())

        generate = {"inputs": "Hello", "parameters": {"max_new_tokens": 4, "details": True, "top_n_tokens": 2,
                                                      "decoder_input_details": True}}
        check("post", "/generate", generate)
        check("post", "/generate", {"inputs": "Hello", "parameters": {
            "max_new_tokens": 3, "details": True, "best_of": 2, "do_sample": True}})
        check("post", "/generate_stream", {"inputs": "Hello", "parameters": {"max_new_tokens": 3, "details": True}},
              "text/event-stream")
        check("post", "/", {"inputs": "Hello", "parameters": {"max_new_tokens": 2}})
        check("post", "/", {"inputs": "Hello", "stream": True, "parameters": {"max_new_tokens": 2}},
              "text/event-stream")
        check("post", "/tokenize", {"inputs": "Hello world"})
        for path in ("/info", "/v1/models", "/version", "/queue"):
            if path in document["paths"]:  # /version when the server has it (the document lists what is served)
                check("get", path)
        chat = {"messages": QUESTION, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}
        check("post", "/v1/chat/completions", chat)
        check("post", "/v1/chat/completions", {**chat, "stream": True, "stream_options": {"include_usage": True}},
              "text/event-stream")
        completion = {"prompt": ["Hello", "Bye"], "max_tokens": 3, "logprobs": 1, "n": 2}
        check("post", "/v1/completions", completion)
        check("post", "/v1/completions", {**completion, "stream": True}, "text/event-stream")


def test_openai_sampling_fields_become_tgi_parameters_of_the_same_meaning():
    sampled = to_generate(check_body(ChatRequest, {
        "messages": QUESTION, "temperature": 0.5, "top_p": 1, "top_k": 5, "frequency_penalty": 0.5, "seed": -1,
        "stop": "x", "logit_bias": {"7": 3}, "min_p": 0.1}), 5)
    assert isinstance(sampled, GenerateParameters)
    assert (sampled.do_sample, sampled.temperature, sampled.top_k) == (True, 0.5, 5)
    assert sampled.top_p is None, "top_p 1 keeps every token, as no top_p does in TGI's parameters"
    assert (sampled.occurrence_penalty, sampled.seed, sampled.stop) == (0.5, 2**64 - 1, ["x"])
    assert (sampled.max_new_tokens, sampled.logit_bias, sampled.min_p) == (5, {"7": 3.0}, 0.1)
    greedy = to_generate(check_body(CompletionRequest, {"prompt": "x", "temperature": 0, "top_p": 0.5}), None)
    assert (greedy.do_sample, greedy.top_p, greedy.max_new_tokens) == (False, None, None)
    with pytest.raises(ValidationError, match="`max_tokens` must be at least 1"):
        to_generate(check_body(CompletionRequest, {"prompt": "x", "max_tokens": 0}), 0)
