"""Several models in one process (``--models-dir``, ``--model-id`` repeated): each request goes to the model it
names (``model`` in OpenAI's bodies, the ``x-model`` header on TGI's routes), loaded when first asked for; with
``--max-loaded-models`` loaded, the least recently used idle one is unloaded; a model whose load fails answers
its requests with the error while the others go on; ``/v1/models`` lists every model with its state and
``/metrics`` labels each sample with its model."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from conftest import DEFAULT_MODEL_FILE, RunningServer, default_gguf, start_server, tiny_llama_config

from tokenmill.config import ConfigError, parse_config
from tokenmill.http.router.catalog import model_config, pooling_checkpoint, served_models
from tokenmill.observability.labelled import merge_expositions

PROMPT = "The capital of France is"
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three tiny random Llamas (different weights, so different greedy tokens) and a broken checkpoint."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    root = tmp_path_factory.mktemp("models")
    gguf = default_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=DEFAULT_MODEL_FILE)
    for seed, name in enumerate(("tiny-a", "tiny-b", "tiny-c")):
        torch.manual_seed(seed)
        LlamaForCausalLM(tiny_llama_config()).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    (root / "zz-broken").mkdir()
    (root / "zz-broken" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                             "model_type": "llama"}))
    (root / "notes.txt").write_text("not a model")
    return root


@pytest.fixture
def server(models_dir: Path, tmp_path: Path) -> Iterator[RunningServer]:
    running = start_server(["--models-dir", str(models_dir), "--max-loaded-models", "2", "--server", "uvicorn",
                            "--dtype", "float32", "--max-concurrent-requests", "16"], tmp_path)
    yield running
    running.stop()


def reference_tokens(model_dir: Path) -> list[int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(model_dir)(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
    return out[0, ids.shape[1]:].tolist()


def generated_tokens(server: RunningServer, model: str) -> list[int]:
    response = httpx.post(f"{server.url}/generate", headers={"x-model": model}, timeout=120, json={
        "inputs": PROMPT, "parameters": {"max_new_tokens": NEW_TOKENS, "details": True}})
    assert response.status_code == 200, response.text
    return [token["id"] for token in response.json()["details"]["tokens"]]


def completion(server: RunningServer, model: str) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "model": model, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0})


def states(server: RunningServer) -> dict[str, str]:
    listed = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    return {model["id"]: model["status"]["value"] for model in listed}


def test_every_checkpoint_is_listed_unloaded_until_asked_for_and_an_unknown_name_loads_nothing(server):
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200, "it can serve: models load on demand"
    unknown = completion(server, "tiny-z")
    assert unknown.status_code == 404 and unknown.json()["error_type"] == "not_found"
    assert "tiny-z" in unknown.json()["error"]
    assert states(server) == {"tiny-a": "unloaded", "tiny-b": "unloaded", "tiny-c": "unloaded",
                              "zz-broken": "unloaded"}


def test_each_model_answers_by_name_with_its_own_greedy_tokens(server, models_dir):
    references = [reference_tokens(models_dir / name) for name in ("tiny-a", "tiny-b", "tiny-c")]
    assert len({tuple(tokens) for tokens in references}) == 3, "the models differ, so a wrong route shows"
    assert generated_tokens(server, "tiny-a") == reference_tokens(models_dir / "tiny-a")
    assert generated_tokens(server, "tiny-b") == reference_tokens(models_dir / "tiny-b")
    by_body = completion(server, "tiny-b")
    assert by_body.status_code == 200 and by_body.json()["model"] == "tiny-b"
    default = httpx.post(f"{server.url}/generate", timeout=120, json={  # no name: the first model
        "inputs": PROMPT, "parameters": {"max_new_tokens": NEW_TOKENS, "details": True}})
    assert [token["id"] for token in default.json()["details"]["tokens"]] == reference_tokens(models_dir / "tiny-a")
    assert states(server)["tiny-a"] == "loaded" and states(server)["tiny-b"] == "loaded"
    text = httpx.get(f"{server.url}/metrics", timeout=10).text  # each sample labelled with its model
    assert 'tgi_request_success{model="tiny-a"} 2.0' in text and 'tgi_request_success{model="tiny-b"} 2.0' in text
    assert text.count("# TYPE tgi_request_success counter") == 1


def test_a_third_model_unloads_the_least_recently_used_idle_one(server, models_dir):
    for name in ("tiny-a", "tiny-b", "tiny-a"):  # tiny-b is now the least recently used
        assert completion(server, name).status_code == 200
    assert generated_tokens(server, "tiny-c") == reference_tokens(models_dir / "tiny-c")
    assert states(server) == {"tiny-a": "loaded", "tiny-b": "unloaded", "tiny-c": "loaded", "zz-broken": "unloaded"}
    assert generated_tokens(server, "tiny-b") == reference_tokens(models_dir / "tiny-b"), "loaded again"
    assert states(server)["tiny-a"] == "unloaded"


def test_concurrent_requests_to_a_model_being_loaded_all_succeed(server, models_dir):
    def stream() -> list[str]:
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=120, json={
                "model": "tiny-c", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "stream": True}) as response:
            assert response.status_code == 200
            return [line for line in response.iter_lines() if line.startswith("data:")]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        generated = [pool.submit(generated_tokens, server, "tiny-c") for _ in range(5)]
        streams = [pool.submit(stream) for _ in range(3)]
        expected = reference_tokens(models_dir / "tiny-c")
        assert all(future.result() == expected for future in generated)
        assert all(lines[-1] == "data: [DONE]" for lines in (future.result() for future in streams))


def test_a_model_that_fails_to_load_answers_with_the_error_and_the_others_go_on(server, models_dir):
    failed = completion(server, "zz-broken")
    assert failed.status_code == 503 and "failed to load" in failed.json()["error"]
    assert states(server)["zz-broken"] == "failed"
    again = completion(server, "zz-broken")
    assert again.status_code == 503 and again.json()["error"] == failed.json()["error"], "not reloaded at once"
    assert server.process.poll() is None, "the process serves on"
    assert generated_tokens(server, "tiny-a") == reference_tokens(models_dir / "tiny-a")


@pytest.mark.slow  # a server of its own
def test_without_the_api_key_nothing_loads(models_dir, tmp_path):
    running = start_server(["--models-dir", str(models_dir), "--server", "uvicorn", "--api-key", "secret"], tmp_path)
    try:
        response = completion(running, "tiny-a")
        assert response.status_code == 401 and response.json()["error_type"] == "authentication"
        info = httpx.get(f"{running.url}/info", headers={"x-model": "tiny-a"}, timeout=10)
        assert info.status_code == 401, "an open route loads no model without the key"
        assert states(running)["tiny-a"] == "unloaded"
        keyed = httpx.post(f"{running.url}/v1/completions", headers={"Authorization": "Bearer secret"}, timeout=120,
                           json={"model": "tiny-a", "prompt": PROMPT, "max_tokens": 2})
        assert keyed.status_code == 200, keyed.text
        info = httpx.get(f"{running.url}/info", headers={"x-model": "tiny-a"}, timeout=10)
        assert info.status_code == 200 and info.json()["model_id"].endswith("tiny-a"), "open once loaded"
    finally:
        running.stop()


class TestCatalog:
    def test_model_id_repeated_serves_several_named_by_their_ids(self):
        config = parse_config(["--model-id", "org/one", "--model-id", "/models/two/"], env={})
        assert config.serves_several() and served_models(config) == {"org/one": "org/one",
                                                                     "/models/two": "/models/two/"}

    def test_the_directory_gives_subdirectories_with_a_config_and_gguf_files(self, tmp_path):
        (tmp_path / "chat").mkdir()
        (tmp_path / "chat" / "config.json").write_text("{}")
        (tmp_path / "empty").mkdir()
        (tmp_path / "small.gguf").write_bytes(b"GGUF")
        config = parse_config(["--models-dir", str(tmp_path)], env={})
        assert served_models(config) == {"chat": str(tmp_path / "chat"), "small": str(tmp_path / "small.gguf")}

    def test_a_directory_without_checkpoints_is_a_clear_error(self, tmp_path):
        with pytest.raises(ConfigError, match="holds no checkpoint"):
            served_models(parse_config(["--models-dir", str(tmp_path)], env={}))
        with pytest.raises(ConfigError, match="no such directory"):
            parse_config(["--models-dir", str(tmp_path / "missing")], env={})

    def test_one_shard_and_no_single_served_name(self, tmp_path):
        with pytest.raises(ConfigError, match="one shard"):
            parse_config(["--models-dir", str(tmp_path), "--num-shard", "2"], env={})
        with pytest.raises(ConfigError, match="--served-model-name"):
            parse_config(["--model-id", "a", "--model-id", "b", "--served-model-name", "x"], env={})

    def test_each_model_takes_a_kth_of_the_kv_memory_and_its_task_from_its_architecture(self, tmp_path):
        (tmp_path / "embedder").mkdir()
        (tmp_path / "embedder" / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
        config = parse_config(["--models-dir", str(tmp_path), "--max-loaded-models", "3"], env={})
        settings = model_config(config, "embedder", str(tmp_path / "embedder"))
        assert pooling_checkpoint(str(tmp_path / "embedder")) and settings.task == "pooling"
        assert settings.kv_memory_fraction == pytest.approx(config.kv_memory_fraction / 3)
        assert settings.served_model_name == "embedder" and not settings.serves_several()
        assert not settings.compile_model, "torch.compile's caches would keep an unloaded model's weights"
        assert settings.max_client_batch_size == 32, "the pooling default, not generation's"
        assert not pooling_checkpoint("org/hub-model")


def test_merged_metrics_write_each_family_once_with_the_label_first():
    merged = merge_expositions("model", {
        "a": b'# HELP x_total help\n# TYPE x_total counter\nx_total 1.0\ny{k="v"} 2.0\n',
        "b\"q": b'# HELP x_total help\n# TYPE x_total counter\nx_total 3.0\n'}).decode()
    assert merged.splitlines() == ['# HELP x_total help', '# TYPE x_total counter', 'x_total{model="a"} 1.0',
                                   'y{model="a",k="v"} 2.0', 'x_total{model="b\\"q"} 3.0']
