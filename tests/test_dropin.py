"""A TGI deployment moved to tokenmill keeps its manifest, its platform's routes and its clients:
TGI's launcher flags start the server (those tokenmill leaves alone each log one warning), LOG_LEVEL
and LOG_FORMAT work, SageMaker's variables and routes work, vLLM's tokenizer routes answer, and
huggingface_hub's InferenceClient runs unchanged."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
from conftest import RunningServer, start_server

from tokenmill.config import ConfigError, parse_config
from tokenmill.config.launcher import LAUNCHER_FLAGS
from tokenmill.observability.logs import log_levels, wants_json

TGI_MANIFEST = ["--sharded", "false", "--cuda-graphs", "0", "--usage-stats", "off", "--speculate", "2",
                "--rope-scaling", "dynamic", "--rope-factor", "2.0", "--shard-uds-path", "/tmp/text-generation-server",
                "--disable-custom-kernels", "--validation-workers", "3", "--enable-prefill-logprobs",
                "--max-client-batch-size", "8", "--max-concurrent-requests", "16", "--max-input-tokens", "512",
                "--max-total-tokens", "1024", "--max-batch-prefill-tokens", "1024", "--payload-limit", "2000000",
                "--json-output"]
"""Flags as a TGI manifest carries them (``--huggingface-hub-cache`` is added per test)."""

IGNORED = ("--cuda-graphs 0", "--usage-stats off", "--rope-scaling dynamic", "--rope-factor 2.0",
           "--shard-uds-path /tmp/text-generation-server", "--enable-prefill-logprobs")


@pytest.fixture(scope="module")
def tgi_server(tiny_model_dir, tmp_path_factory) -> Iterator[RunningServer]:
    """A server started with a TGI manifest's flags, LOG_LEVEL in TGI's per-target form and a served name."""
    cache = tmp_path_factory.mktemp("hub-cache")
    running = start_server(["--model-id", str(tiny_model_dir), "--server", "uvicorn", "--backend", "paged",
                            "--huggingface-hub-cache", str(cache), "--served-model-name", "tiny-served",
                            *TGI_MANIFEST], tmp_path_factory.mktemp("tgi"),
                           env={"LOG_LEVEL": "warn,tokenmill=info"})
    yield running
    running.stop()


@pytest.fixture(scope="module")
def sagemaker_server(tiny_model_dir, tmp_path_factory) -> Iterator[RunningServer]:
    """Started as SageMaker starts TGI's image: the model in HF_MODEL_ID, a CPU instance's SM_NUM_GPUS=0;
    grammars turned off and only warnings logged."""
    running = start_server(["--server", "uvicorn", "--disable-grammar-support", "--max-total-tokens", "512"],
                           tmp_path_factory.mktemp("sagemaker"),
                           env={"HF_MODEL_ID": str(tiny_model_dir), "SM_NUM_GPUS": "0", "LOG_LEVEL": "warn"})
    yield running
    running.stop()


def json_lines(server: RunningServer) -> list[dict]:
    lines = []
    for line in server.log().splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            continue
    return lines


def test_a_tgi_manifest_starts_and_each_flag_left_alone_says_what_tokenmill_does_instead(tgi_server):
    warnings = [entry["message"] for entry in json_lines(tgi_server) if entry["level"] == "WARNING"]
    for flag in IGNORED:
        said = [line for line in warnings if line.startswith(f"{flag} is TGI's and has no effect in tokenmill: ")]
        assert len(said) == 1, (flag, warnings)
    with tgi_server.client() as client:
        info = client.get("/info").json()
        generated = client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}})
    assert generated.status_code == 200
    assert info["validation_workers"] == 3 and info["max_client_batch_size"] == 8
    assert info["max_concurrent_requests"] == 16 and info["num_shard"] == 1


def test_log_level_takes_tgis_per_target_form_and_log_format_json_writes_json_lines(tgi_server, tiny_model_dir,
                                                                                    tmp_path):
    entries = json_lines(tgi_server)
    assert entries, tgi_server.log()[:2000]
    levels = {entry["level"] for entry in entries}
    # warn for everyone, info for tokenmill's own loggers: uvicorn's INFO lines are gone, tokenmill's stay
    assert not [e for e in entries if e["level"] == "INFO" and not e["target"].startswith("tokenmill")]
    assert "INFO" in levels and any(e["target"].startswith("tokenmill") for e in entries)
    assert log_levels("warn,text_generation_router::server=debug") == {"": 30, "text_generation_router.server": 10}
    with pytest.raises(ConfigError, match="LOG_LEVEL"):
        parse_config([], {"LOG_LEVEL": "loud"})
    assert wants_json(False, {"LOG_FORMAT": "json"}) and not wants_json(False, {"LOG_FORMAT": "text"})


def test_served_model_name_names_the_model_in_responses_and_the_model_list(tgi_server):
    with tgi_server.client() as client:
        models = client.get("/v1/models").json()["data"]
        chat = client.post("/v1/chat/completions", json={"model": "tiny-served", "max_tokens": 2,
                                                         "messages": [{"role": "user", "content": "Hi"}]}).json()
    assert models[0]["id"] == "tiny-served" and chat["model"] == "tiny-served"


def test_every_tgi_launcher_flag_is_accepted_and_its_variable_too():
    for flag in LAUNCHER_FLAGS:
        name = "--" + flag.name.replace("_", "-")
        argv = [name] if not flag.takes_value else [name, "1"]
        config = parse_config(argv, {})
        assert len(config.notices) == 1, flag
        if flag.environment:
            assert len(parse_config([], {flag.name.upper(): "1" if flag.takes_value else "true"}).notices) == 1
    implemented = parse_config(["--sharded", "false", "--huggingface-hub-cache", "/cache", "--disable-grammar-support",
                                "--tokenizer-config-path", "/t.json", "-p", "8000"], {})
    assert implemented.notices == () and implemented.port == 8000 and implemented.huggingface_hub_cache == "/cache"
    repeated = parse_config(["--cors-allow-origin", "https://a", "--cors-allow-origin", "https://b"],
                            {"CORS_ALLOW_ORIGIN": "https://c"})
    assert repeated.cors_allow_origin == "https://a,https://b"  # TGI's repeated form; the flags win over the variable


def test_sharded_settles_the_shard_count_as_tgi_does():
    assert parse_config(["--sharded", "true", "--num-shard", "2"], {}).num_shard == 2
    assert parse_config([], {"SHARDED": "false"}).num_shard == 1
    with pytest.raises(ConfigError, match="--sharded false contradicts --num-shard 2"):
        parse_config(["--sharded", "false", "--num-shard", "2"], {})
    with pytest.raises(ConfigError, match="every visible GPU"):  # these machines have none
        parse_config(["--sharded", "true"], {})


def test_a_flag_that_neither_tokenmill_nor_tgi_has_is_a_clear_error(tmp_path):
    done = subprocess.run([sys.executable, "-m", "tokenmill", "launch", "--no-such-flag", "3"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "unrecognized arguments: --no-such-flag 3" in done.stderr


def test_backend_vllm_without_its_package_says_which_package_to_install():
    done = subprocess.run([sys.executable, "-m", "tokenmill", "launch", "--backend", "vllm"],
                          capture_output=True, text=True, timeout=120, env={"TOKENMILL_DISABLE_PLUGIN_AUTOLOAD": "1",
                                                                           "PATH": "/usr/bin:/bin"})
    assert done.returncode == 2 and "pip install tokenmill-vllm" in done.stderr, done.stderr


def test_sagemaker_variables_start_the_model_and_its_routes_answer(sagemaker_server, tiny_model_dir):
    with sagemaker_server.client() as client:
        ping = client.get("/ping")
        generate = client.post("/invocations", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}})
        chat = client.post("/invocations", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        completion = client.post("/invocations", json={"prompt": "Hello", "max_tokens": 2})
        info = client.get("/info").json()
    assert ping.status_code == 200 and info["model_id"] == str(tiny_model_dir)
    assert generate.status_code == 200 and "generated_text" in generate.json()[0]
    assert chat.json()["object"] == "chat.completion" and completion.json()["object"] == "text_completion"


def test_log_level_warn_leaves_out_info_lines(sagemaker_server):
    assert not [line for line in sagemaker_server.log().splitlines() if " INFO " in line]


def test_disable_grammar_support_refuses_every_constrained_generation(sagemaker_server):
    refused = "grammar support is disabled on this server (--disable-grammar-support)"
    weather = {"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    with sagemaker_server.client() as client:
        answers = [
            client.post("/generate", json={"inputs": "Hi",
                                           "parameters": {"grammar": {"type": "regex", "value": "a+"}}}),
            client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                      "response_format": {"type": "json_object"}}),
            client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                      "tools": [weather], "tool_choice": "required"}),
        ]
        free = client.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}})
    for answer in answers:
        assert answer.status_code == 422 and refused in answer.json()["error"], answer.text
    assert free.status_code == 200


def test_get_root_is_tgis_health_check_and_post_root_still_generates(tgi_server):
    with tgi_server.client() as client:
        health = client.get("/")
        generated = client.post("/", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}})
    assert health.status_code == 200
    assert generated.status_code == 200 and isinstance(generated.json(), list)


def test_chat_tokenize_shows_the_prompt_the_chat_route_runs(tgi_server):
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
            "max_tokens": 1}
    with tgi_server.client() as client:
        tokenized = client.post("/chat_tokenize", json=body).json()
        usage = client.post("/v1/chat/completions", json=body).json()["usage"]
        bad = client.post("/chat_tokenize", json={"messages": []})
    assert "Be brief." in tokenized["templated_text"] and "Hi there" in tokenized["templated_text"]
    assert len(tokenized["tokenize_response"]) == usage["prompt_tokens"]
    first = tokenized["tokenize_response"][1]
    assert tokenized["templated_text"][first["start"]:first["stop"]] == first["text"]
    assert bad.status_code == 422 and bad.json()["error_type"] == "validation"


def test_detokenize_inverts_tokenize_and_refuses_ids_the_model_lacks(tgi_server):
    with tgi_server.client() as client:
        ids = [token["id"] for token in client.post("/tokenize", json={"inputs": "Hello world"}).json()]
        text = client.post("/detokenize", json={"tokens": ids}).json()
        beyond = client.post("/detokenize", json={"tokens": [10**9]})
        wrong = client.post("/detokenize", json={"tokens": "12"})
    assert text == {"prompt": "Hello world"}
    assert beyond.status_code == 422 and wrong.status_code == 422


def test_tokenize_answers_vllms_bodies_in_vllms_shape_and_tgis_in_tgis(tgi_server):
    messages = [{"role": "user", "content": "Hello world"}]
    with tgi_server.client() as client:
        tgi = client.post("/tokenize", json={"inputs": "Hello world"}).json()
        prompt = client.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
        chat = client.post("/tokenize", json={"model": "any", "messages": messages}).json()
        templated = client.post("/chat_tokenize", json={"messages": messages}).json()
        open_turn = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
        info = client.get("/info").json()
        refused = [client.post("/tokenize", json=body) for body in (
            {"prompt": 12}, {"messages": []}, {"messages": messages, "add_special_tokens": "yes"})]
    assert [token["id"] for token in tgi] == prompt["tokens"] and prompt["count"] == len(prompt["tokens"])
    assert prompt["token_strs"] == [token["text"].replace(" ", "Ġ") for token in tgi]
    assert prompt["max_model_len"] == info["max_total_tokens"]
    assert chat["tokens"] == [token["id"] for token in templated["tokenize_response"]]
    assert chat["token_strs"] is None and chat["count"] == len(chat["tokens"])
    assert open_turn["count"] < chat["count"], "without the generation prompt, the assistant's turn is not opened"
    assert all(r.status_code == 422 and r.json()["error_type"] == "validation" for r in refused)


def test_tokenizer_info_and_version_answer_as_vllm_does(tgi_server):
    from tokenmill import __version__

    with tgi_server.client() as client:
        info = client.get("/tokenizer_info").json()
        version = client.get("/version").json()
    assert info["tokenizer_class"] and info["chat_template"] and info["eos_token"]
    assert version == {"version": __version__}


def test_huggingface_hubs_inference_client_runs_unchanged(tgi_server):
    from huggingface_hub import InferenceClient

    client = InferenceClient(base_url=tgi_server.url)
    whole = client.text_generation("Hello", max_new_tokens=4, details=True, decoder_input_details=True)
    assert whole.details.generated_tokens == len(whole.details.tokens) and whole.details.prefill
    streamed = list(client.text_generation("Hello", max_new_tokens=4, stream=True, details=True))
    assert streamed[-1].details is not None and streamed[-1].generated_text == whole.generated_text
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
              "additionalProperties": False}
    chat = client.chat_completion([{"role": "user", "content": "Yes or no?"}], max_tokens=30,
                                  response_format={"type": "json", "value": schema})
    assert "a" in json.loads(chat.choices[0].message.content)


def test_tgis_tool_prompt_leads_in_the_tools_the_model_reads(tgi_server):
    weather = {"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    body = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [weather],
            "tool_prompt": "Pick one of these tools, carefully."}
    with tgi_server.client() as client:
        templated = client.post("/chat_tokenize", json=body).json()["templated_text"]
        default = client.post("/chat_tokenize", json={**body, "tool_prompt": None}).json()["templated_text"]
    assert "Pick one of these tools, carefully.\n[" in templated and '"weather"' in templated
    assert "Pick one" not in default and "You can call these functions:" in default
