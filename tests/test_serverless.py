"""Scale from zero: with ``--hold-while-loading N``, requests that arrive while the model downloads and
loads wait for it (a stream keeps its connection with SSE comments) and are answered once it is ready; the
N+1-th gets its 503 at once, ``/health`` says 503 until ready, and a load that fails answers the held
requests with its error. The model comes from a stand-in hub on loopback whose link is slow."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import RunningServer, launch_server
from test_download import TOKEN, Repo, StandInHub

SLOW_LINK_SECONDS = 1.5
"""Before each file's answer: the tiny model's download takes several seconds."""

PROMPT = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 6}}


@pytest.fixture
def slow_hub(tiny_model_dir: Path) -> Iterator[StandInHub]:
    files = {path.name: path.read_bytes() for path in tiny_model_dir.iterdir() if path.is_file()}
    hub = StandInHub({"org/tiny": Repo(files, delay=SLOW_LINK_SECONDS),
                      "org/gated": Repo(files, token=TOKEN, delay=SLOW_LINK_SECONDS)})
    thread = threading.Thread(target=hub.serve_forever, daemon=True)
    thread.start()
    yield hub
    hub.shutdown()
    hub.server_close()


def launch_from_hub(hub: StandInHub, repo: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                    *args: str) -> RunningServer:
    """A server downloading ``repo`` from ``hub``, returned once it answers (503) on /health."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(variable, raising=False)
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "0"}
    server = launch_server(["--model-id", repo, "--server", "uvicorn", *args], tmp_path, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            assert httpx.get(f"{server.url}/health", timeout=2).status_code == 503, "ready before the test began"
            return server
        except httpx.TransportError:
            time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"the server never answered:\n{server.log()}")


def stream_lines(url: str, path: str, body: dict[str, Any]) -> tuple[int, list[str]]:
    with httpx.stream("POST", url + path, json=body, timeout=120) as response:
        return response.status_code, [line for line in response.iter_lines() if line]


def generate_and_stream(server: RunningServer, stream_path: str, stream_body: dict[str, Any],
                        meanwhile: Callable[[], Any] = lambda: None
                        ) -> tuple[httpx.Response, tuple[int, list[str]], Any]:
    """A ``/generate`` and a stream sent together, and what ``meanwhile`` returns, run while they wait."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        held = pool.submit(httpx.post, f"{server.url}/generate", json=PROMPT, timeout=120)
        streamed = pool.submit(stream_lines, server.url, stream_path, stream_body)
        other = meanwhile()
        return held.result(), streamed.result(), other


def test_requests_that_arrive_while_the_model_loads_are_answered_once_it_is_ready(
        slow_hub: StandInHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = launch_from_hub(slow_hub, "org/tiny", tmp_path, monkeypatch, "--hold-while-loading", "2")
    try:
        def meanwhile() -> tuple[httpx.Response, int]:  # a third request, and /health, while two are held
            time.sleep(1.0)
            return (httpx.post(f"{server.url}/generate", json=PROMPT, timeout=10),
                    httpx.get(f"{server.url}/health", timeout=10).status_code)

        answer, (stream_status, lines), (over, health_while_held) = generate_and_stream(
            server, "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}, meanwhile)
        again = httpx.post(f"{server.url}/generate", json=PROMPT, timeout=60)
    finally:
        server.stop()
    assert over.status_code == 503 and over.json()["error_type"] == "unhealthy"  # the third: over the cap
    assert health_while_held == 503
    assert answer.status_code == 200, answer.text
    assert answer.json()["generated_text"] == again.json()["generated_text"]  # as once ready
    assert stream_status == 200
    assert lines[0] == ": loading the model"  # a heartbeat while the model loads
    events = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: {")]
    assert events and events[-1]["choices"][0]["finish_reason"] and lines[-1] == "data: [DONE]"


def test_a_client_that_leaves_while_held_gives_its_place_back_and_a_body_over_the_limit_is_not_held(
        slow_hub: StandInHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = launch_from_hub(slow_hub, "org/tiny", tmp_path, monkeypatch, "--hold-while-loading", "1",
                             "--payload-limit", "1000")
    try:
        with pytest.raises(httpx.ReadTimeout):  # held, then the client gives up
            httpx.post(f"{server.url}/generate", json=PROMPT, timeout=1.0)
        too_large = httpx.post(f"{server.url}/generate", timeout=10,  # not held: the 503 of a loading server
                               json={"inputs": "x" * 2000, "parameters": {"max_new_tokens": 2}})
        time.sleep(0.5)  # the server notices the first client left
        answer = httpx.post(f"{server.url}/generate", json=PROMPT, timeout=120)  # the one place is free again
    finally:
        server.stop()
    assert too_large.status_code == 503
    assert answer.status_code == 200, answer.text


def test_a_load_that_fails_answers_the_held_requests_with_its_error(
        slow_hub: StandInHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = launch_from_hub(slow_hub, "org/gated", tmp_path, monkeypatch, "--hold-while-loading", "4")
    try:
        answer, (stream_status, lines), _ = generate_and_stream(server, "/generate_stream", PROMPT)
        server.process.wait(30)
    finally:
        server.stop()
    assert answer.status_code == 503
    assert "failed to load" in answer.json()["error"] and "org/gated" in answer.json()["error"]
    assert stream_status == 200  # the stream had started: its error is its last event
    error = json.loads(lines[-1].removeprefix("data: "))
    assert error["error_type"] == "unhealthy" and "failed to load" in error["error"]
    assert server.process.returncode == 3


def test_without_the_flag_a_request_while_loading_is_a_503_at_once(
        slow_hub: StandInHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = launch_from_hub(slow_hub, "org/tiny", tmp_path, monkeypatch)
    try:
        answer = httpx.post(f"{server.url}/generate", json=PROMPT, timeout=10)
    finally:
        server.stop()
    assert answer.status_code == 503 and "not ready yet" in answer.json()["error"]


# --- sleeping while idle --------------------------------------------------------------------------------

KV_BYTES_PER_TOKEN = 8 * 2 * 4 * 64 * 4  # layers × (keys, values) × kv heads × head dim × float32


@pytest.fixture(scope="module")
def wide_kv_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama whose KV cache is wide (16 KB a token), so that what it holds shows in RSS."""
    from conftest import tiny_llama_config
    from transformers import AutoTokenizer, LlamaForCausalLM

    from tokenmill.model.loading import DEFAULT_MODEL_FILE, default_gguf

    target = tmp_path_factory.mktemp("wide-kv")
    config = tiny_llama_config()
    config.num_hidden_layers, config.num_key_value_heads, config.head_dim = 8, 4, 64
    import torch

    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(target)
    gguf = default_gguf()
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=DEFAULT_MODEL_FILE).save_pretrained(target)
    return target


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_an_idle_server_sleeps_gives_its_kv_memory_back_and_wakes_for_the_next_request(
        wide_kv_model_dir: Path, tmp_path: Path) -> None:
    from conftest import start_server

    server = start_server(["--model-id", str(wide_kv_model_dir), "--server", "uvicorn", "--dtype", "float32",
                           "--backend", "paged", "--sleep-after-idle", "2"], tmp_path)
    long_prompts = [" ".join(f"w{seed}x{i}" for i in range(250)) for seed in range(4)]  # 1,400 tokens each
    try:
        with server.client() as client:
            before = client.post("/generate", json=PROMPT).json()["generated_text"]
            for prompt in long_prompts:  # their blocks stay in the prefix cache: memory the pool touched
                done = client.post("/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 1}})
                assert done.status_code == 200, done.text
            awake_rss = rss_bytes(server.process.pid)
            assert client.get("/is_sleeping").json() == {"is_sleeping": False}
            deadline = time.monotonic() + 30
            while not client.get("/is_sleeping").json()["is_sleeping"] and time.monotonic() < deadline:
                time.sleep(0.2)
            asleep_rss = rss_bytes(server.process.pid)
            info, health = client.get("/info").json(), client.get("/health").status_code
            gauge = [line for line in client.get("/metrics").text.splitlines() if line.startswith("tokenmill_sleeping")]
            after = client.post("/generate", json=PROMPT).json()["generated_text"]
            woken = client.get("/is_sleeping").json()["is_sleeping"]
    finally:
        server.stop()
    assert info["sleeping"] is True and health == 200  # asleep, and still able to serve
    assert gauge == ["tokenmill_sleeping 1.0"]
    held_kv = 4 * 1_200 * KV_BYTES_PER_TOKEN
    assert awake_rss - asleep_rss > held_kv / 2, (awake_rss, asleep_rss)
    assert after == before and woken is False


def test_sleep_and_wake_up_on_demand(tiny_model_dir: Path, tmp_path: Path) -> None:
    from conftest import start_server

    server = start_server(["--model-id", str(tiny_model_dir), "--server", "uvicorn", "--api-key", "k"], tmp_path)
    try:
        with server.client() as client:
            headers = {"Authorization": "Bearer k"}
            unauthorized = client.post("/sleep").status_code
            before = client.post("/generate", json=PROMPT, headers=headers).json()["generated_text"]
            slept = client.post("/sleep", headers=headers).json()
            sleeping = client.get("/is_sleeping", headers=headers).json()["is_sleeping"]
            woke = client.post("/wake_up", headers=headers).json()
            client.post("/sleep", headers=headers)
            after = client.post("/generate", json=PROMPT, headers=headers).json()["generated_text"]
            cross_site = [client.post(path, headers={**headers, "Sec-Fetch-Site": "cross-site"}).status_code
                          for path in ("/sleep", "/wake_up")]  # another site's page changes nothing
    finally:
        server.stop()
    assert unauthorized == 401
    assert slept == {"is_sleeping": True} and sleeping is True and woke == {"is_sleeping": False}
    assert after == before  # a request wakes it, and the answer is the same
    assert cross_site == [403, 403]
