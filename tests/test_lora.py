"""LoRA adapters: PEFT checkpoints served over one base model, mixed in one batch, cached within a limit."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import RunningServer, start_server
from engine_helpers import PROMPTS, reference_greedy

from bench.lora import write_random_adapter

peft = pytest.importorskip("peft", reason="the LoRA tests make their adapters with peft")

NEW_TOKENS = 12


def merged_greedy(base_dir: Path, adapter_dir: Path | None, tokenizer: Any, prompt: str) -> list[int]:
    """What peft's merged model generates greedily (the base model's when ``adapter_dir`` is None)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    return reference_greedy(model.eval(), tokenizer, prompt, NEW_TOKENS, eos_token_id=2)


PROMPT_OF: dict[str | None, str] = {None: PROMPTS[6], "ad0": PROMPTS[1], "ad1": PROMPTS[2], "ad2": PROMPTS[7]}
"""Prompts of different lengths, so that a mixed batch's rows and padding differ per adapter."""


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """Five adapters; ``ad2`` adapts only q and v, so a mixed batch has layers some adapters leave alone."""
    root = tmp_path_factory.mktemp("adapters")
    made = {f"ad{i}": write_random_adapter(root / f"ad{i}", seed=100 + i, base_dir=tiny_model_dir)
            for i in (0, 1, 3, 4)}
    made["ad2"] = write_random_adapter(root / "ad2", seed=102, base_dir=tiny_model_dir, targets=["q_proj", "v_proj"])
    return made


@pytest.fixture(scope="module")
def expected(tiny_model_dir, tiny_model, adapters) -> dict[str | None, list[int]]:
    """peft's merged-model tokens for each adapter's prompt (None: the base model)."""
    _, tokenizer = tiny_model
    return {name: merged_greedy(tiny_model_dir, adapters[name] if name else None, tokenizer, prompt)
            for name, prompt in PROMPT_OF.items()}


@pytest.fixture(scope="module", params=[pytest.param("transformers", marks=pytest.mark.slow), "paged"])
def lora_server(request, tiny_model_dir, adapters, tmp_path_factory) -> Iterator[RunningServer]:
    listed = ",".join(f"{name}={adapters[name]}" for name in ("ad0", "ad1", "ad2"))
    runtime = tmp_path_factory.mktemp("runtime-adapters")
    server = start_server(["--model-id", str(tiny_model_dir), "--server", "uvicorn", "--max-total-tokens", "512",
                           "--backend", request.param, "--lora-adapters", listed, "--max-lora-rank", "16",
                           "--allow-adapter-loading", "--lora-adapter-dir", str(adapters["ad0"].parent),
                           "--lora-adapter-dir", str(runtime), "--dtype", "float32"],  # as the peft reference
                          tmp_path_factory.mktemp("lora"))
    server.backend = request.param
    server.runtime_dir = runtime
    yield server
    server.stop()


def greedy(server: RunningServer, adapter: str | None, prompt: str | None = None) -> list[int]:
    prompt = prompt or PROMPT_OF[adapter]
    parameters: dict[str, Any] = {"max_new_tokens": NEW_TOKENS, "details": True}
    if adapter is not None:
        parameters["adapter_id"] = adapter
    with server.client() as client:
        answer = client.post("/generate", json={"inputs": prompt, "parameters": parameters})
    assert answer.status_code == 200, answer.text
    return [token["id"] for token in answer.json()["details"]["tokens"]]


def test_each_adapter_generates_what_peft_merged_model_does(lora_server, expected):
    for name in ("ad0", "ad1", "ad2"):
        assert greedy(lora_server, name) == expected[name], name
    assert len({tuple(tokens) for tokens in expected.values()}) == 4  # the adapters really change the output


def test_no_adapter_or_the_base_model_id_means_the_base_model(lora_server, expected, tiny_model_dir):
    assert greedy(lora_server, None) == expected[None]
    assert greedy(lora_server, str(tiny_model_dir), PROMPT_OF[None]) == expected[None]


def test_a_batch_mixing_three_adapters_and_the_base_model_gives_each_its_own_tokens(lora_server, expected):
    names = [None, "ad0", "ad1", "ad2"] * 3
    with ThreadPoolExecutor(len(names)) as pool:
        outputs = list(pool.map(lambda name: greedy(lora_server, name), names))
    for name, tokens in zip(names, outputs):
        assert tokens == expected[name], name


def test_openai_model_names_the_adapter_and_v1_models_lists_them(lora_server, expected, tiny_model):
    _, tokenizer = tiny_model
    with lora_server.client() as client:
        models = [m["id"] for m in client.get("/v1/models").json()["data"]]
        completion = client.post("/v1/completions", json={"model": "ad1", "prompt": PROMPT_OF["ad1"],
                                                         "max_tokens": NEW_TOKENS, "temperature": 0}).json()
    assert models[1:] == ["ad0", "ad1", "ad2"]
    assert completion["model"] == "ad1"
    assert completion["choices"][0]["text"] == tokenizer.decode(expected["ad1"], skip_special_tokens=True)


def test_two_adapters_on_one_prompt_never_share_its_cached_blocks(lora_server, adapters, tiny_model_dir, tiny_model):
    _, tokenizer = tiny_model
    prompt = "Shared by every adapter. " + PROMPTS[6] * 2  # several blocks of its own
    expected = {name: merged_greedy(tiny_model_dir, adapters[name] if name else None, tokenizer, prompt)
                for name in (None, "ad0", "ad1")}
    assert len({tuple(tokens) for tokens in expected.values()}) == 3

    def complete(name: str | None) -> tuple[str, int]:
        with lora_server.client() as client:
            answer = client.post("/v1/completions", json={"model": name or "base", "prompt": prompt,
                                                          "max_tokens": NEW_TOKENS, "temperature": 0}).json()
        return answer["choices"][0]["text"], answer["usage"]["prompt_tokens_details"]["cached_tokens"]

    order = [None, "ad0", "ad1", "ad0", None, "ad1"]
    answers = [complete(name) for name in order]
    for name, (text, _) in zip(order, answers):
        assert text == tokenizer.decode(expected[name], skip_special_tokens=True), name
    cached = [count for _, count in answers]
    assert cached[:3] == [0, 0, 0]  # each adapter's first run: nothing of another's is reused
    if lora_server.backend == "paged":
        assert all(count > 0 for count in cached[3:])  # ... and its second takes its own blocks


def test_an_unknown_adapter_is_a_422_that_lists_the_known_ones(lora_server):
    with lora_server.client() as client:
        answer = client.post("/generate", json={"inputs": "hi", "parameters": {"adapter_id": "nope"}})
    assert answer.status_code == 422
    assert "unknown adapter 'nope'" in answer.json()["error"] and "ad0, ad1, ad2" in answer.json()["error"]


def test_an_adapter_is_loaded_at_run_time_and_serves_at_once(lora_server, adapters, tiny_model_dir, tiny_model):
    _, tokenizer = tiny_model
    with lora_server.client() as client:
        loaded = client.post("/adapters", json={"id": "late", "path": str(adapters["ad4"])})
        assert loaded.status_code == 200 and loaded.json()["rank"] == 8
        assert "late" in client.get("/adapters").json()["adapters"]
    assert greedy(lora_server, "late", PROMPTS[1]) == merged_greedy(tiny_model_dir, adapters["ad4"], tokenizer,
                                                                     PROMPTS[1])


def test_adapters_that_do_not_fit_are_refused_with_the_reason(lora_server, tiny_model_dir):
    from transformers import LlamaConfig

    other_base = LlamaConfig(vocab_size=49152, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=24)
    allowed = lora_server.runtime_dir
    wrong_shape = write_random_adapter(allowed / "wrong", seed=1, config=other_base)
    too_big = write_random_adapter(allowed / "big", seed=2, rank=32, base_dir=tiny_model_dir)
    embedding = write_random_adapter(allowed / "emb", seed=3, base_dir=tiny_model_dir,
                                     targets=["embed_tokens", "q_proj"])
    (allowed / "empty").mkdir(exist_ok=True)
    with lora_server.client() as client:
        shape = client.post("/adapters", json={"id": "wrong", "path": str(wrong_shape)})
        rank = client.post("/adapters", json={"id": "big", "path": str(too_big)})
        missing = client.post("/adapters", json={"id": "gone", "path": "empty"})  # relative to a --lora-adapter-dir
        embeds = client.post("/adapters", json={"id": "emb", "path": str(embedding)})
        base_id = client.post("/adapters", json={"id": str(tiny_model_dir), "path": str(embedding)})
        odd_ids = [client.post("/adapters", json={"id": odd, "path": str(embedding)})
                   for odd in ("a\0b", "org/../ad0", "tab\tname")]
        known = client.get("/adapters").json()["adapters"]
    assert shape.status_code == 422 and "trained for another base model" in shape.json()["error"]
    assert rank.status_code == 422 and "above --max-lora-rank 16" in rank.json()["error"]
    assert missing.status_code == 422 and "no adapter_config.json" in missing.json()["error"]
    assert str(allowed) not in missing.json()["error"]  # errors name the adapter, never a server path
    assert embeds.status_code == 422 and "also changes model.embed_tokens" in embeds.json()["error"]
    assert base_id.status_code == 422 and "the base model is served under" in base_id.json()["error"]
    assert [answer.status_code for answer in odd_ids] == [422] * 3
    assert not {"wrong", "big", "gone", "emb"} & set(known)  # nothing refused is learnt


def test_adapters_load_at_run_time_only_from_the_adapter_directories(lora_server, adapters, tiny_model_dir):
    outside = lora_server.runtime_dir.parent / "elsewhere"
    write_random_adapter(outside, seed=9, base_dir=tiny_model_dir)
    with lora_server.client() as client:
        absolute = client.post("/adapters", json={"id": "out", "path": str(outside)})
        climbing = client.post("/adapters", json={"id": "up", "path": "../elsewhere"})
        inside = client.post("/adapters", json={"id": "in", "path": "ad3"})  # relative to the first directory
        pathless = client.post("/adapters", json={"id": str(outside)})  # an id that names a directory: no way in
    assert pathless.status_code == 403 and "loads a hub id (org/name) only" in pathless.json()["error"]
    for answer in (absolute, climbing):
        assert answer.status_code == 403 and answer.json()["error_type"] == "forbidden"
        assert "inside a --lora-adapter-dir" in answer.json()["error"] and str(outside) not in answer.text
    assert inside.status_code == 200, inside.text


def test_without_an_api_key_or_opt_in_no_adapter_loads_at_run_time(tiny_model_dir, adapters, tmp_path):
    server = start_server(["--model-id", str(tiny_model_dir), "--server", "uvicorn", "--max-total-tokens", "256",
                           "--lora-cache-limit", "2", "--lora-adapter-dir", str(adapters["ad0"].parent)], tmp_path)
    try:
        with server.client() as client:
            answer = client.post("/adapters", json={"id": "ad4", "path": "ad4"})
            listed = client.get("/adapters").json()["adapters"]
    finally:
        server.stop()
    assert answer.status_code == 403 and "--api-key" in answer.json()["error"] and "ad4" not in listed


# ---- the bounded cache ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def big_adapters(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """Five adapters of rank 64, 512 KiB each: keeping evicted ones alive would show in resident memory."""
    root = tmp_path_factory.mktemp("big-adapters")
    return {f"big{i}": write_random_adapter(root / f"big{i}", seed=200 + i, rank=64, base_dir=tiny_model_dir)
            for i in range(5)}


@pytest.fixture(scope="module")
def small_cache_server(tiny_model_dir, big_adapters, tmp_path_factory) -> Iterator[RunningServer]:
    listed = ",".join(f"{name}={path}" for name, path in big_adapters.items())
    server = start_server(["--model-id", str(tiny_model_dir), "--server", "uvicorn", "--max-total-tokens", "512",
                           "--lora-adapters", listed, "--lora-cache-limit", "2", "--stream-buffer-tokens", "2"],
                          tmp_path_factory.mktemp("lora-cache"))
    yield server
    server.stop()


def cache_state(server: RunningServer) -> dict[str, Any]:
    with server.client() as client:
        return client.get("/adapters").json()


def test_the_cache_limit_holds_while_requests_cycle_through_more_adapters_and_memory_stays_flat(
        small_cache_server, big_adapters, tiny_model_dir, tiny_model):
    import psutil

    _, tokenizer = tiny_model
    process = psutil.Process(small_cache_server.process.pid)
    names = list(big_adapters)
    first = merged_greedy(tiny_model_dir, big_adapters["big0"], tokenizer, PROMPTS[1])

    def cycle() -> None:
        for name in names:
            tokens = greedy(small_cache_server, name, PROMPTS[1])
            if name == "big0":
                assert tokens == first  # reloaded after an eviction, still the same adapter
            assert len(cache_state(small_cache_server)["loaded"]) <= 2

    cycle()
    cycle()
    warmed = process.memory_info().rss
    for _ in range(6):
        cycle()
    grown = process.memory_info().rss - warmed
    state = cache_state(small_cache_server)
    assert state["evictions"] >= 30 and state["loads"] >= 30
    assert state["bytes"] <= 2 * 512 * 2**10
    assert grown < 6 * 2**20, f"resident memory grew by {grown / 2**20:.1f} MiB over 30 swaps of 512 KiB adapters"
    with small_cache_server.client() as client:
        metrics = client.get("/metrics").text
    assert "tgi_lora_cache_size 2.0" in metrics


def test_an_adapter_in_use_is_never_evicted(small_cache_server):
    """Two slow streams pin both slots: a third adapter must wait for one, and gets 429 meanwhile."""
    events: list[dict] = []

    def slow_stream(name: str) -> None:
        body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 300, "adapter_id": name}}
        with small_cache_server.client() as client, client.stream("POST", "/generate_stream", json=body) as answer:
            for line in answer.iter_lines():
                if line.startswith("data:"):
                    events.append(json.loads(line[5:]))
                    time.sleep(0.01)

    readers = [threading.Thread(target=slow_stream, args=(name,)) for name in ("big0", "big1")]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + 60
    while len(events) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    with small_cache_server.client() as client:  # both slots pinned by running requests
        busy = client.post("/generate", json={"inputs": "hi", "parameters": {"adapter_id": "big2"}})
    assert busy.status_code == 429 and "in use" in busy.json()["error"]
    assert sorted(cache_state(small_cache_server)["loaded"]) == ["big0", "big1"]
    for reader in readers:
        reader.join(120)
    assert greedy(small_cache_server, "big2", PROMPTS[1])  # a slot is free again


# ---- the real model ------------------------------------------------------------------------------


@pytest.mark.slow
def test_an_adapter_on_smollm2_generates_what_peft_merged_model_does(tmp_path):
    from transformers import AutoTokenizer

    from tokenmill.model.loading import converted_gguf, default_gguf

    base_dir = converted_gguf(default_gguf())
    adapter_dir = write_random_adapter(tmp_path / "smol-adapter", seed=7, rank=8, base_dir=base_dir)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    server = start_server(["--model-id", str(base_dir), "--server", "uvicorn", "--max-total-tokens", "512",
                           "--lora-adapters", f"smol={adapter_dir}", "--dtype", "float32"], tmp_path)
    try:
        for prompt in PROMPTS[2:4]:
            with_adapter = greedy(server, "smol", prompt)
            assert with_adapter == merged_greedy(base_dir, adapter_dir, tokenizer, prompt)
            assert with_adapter != greedy(server, None, prompt)
    finally:
        server.stop()


def test_an_adapter_may_not_take_a_name_the_base_model_is_served_under():
    from tokenmill.model.adapters import adapter_id_refusal

    served = frozenset({"org/base", "chat"})
    assert "served under" in adapter_id_refusal("chat", served)  # every client naming "chat" would get it
    assert "served under" in adapter_id_refusal("org/base", served)
    for odd in ("", "a=b", "a,b", "nul\0", "up/../ad", "..", "line\nbreak"):
        assert adapter_id_refusal(odd, served), odd
    assert adapter_id_refusal("org/sql-lora", served) is None and adapter_id_refusal("ad0", served) is None

