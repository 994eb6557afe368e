"""Shared fixtures: a tiny random Llama with the SmolLM2 tokenizer, and a real server on loopback."""

from __future__ import annotations

import importlib.util
import os
import site
import socket
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from otlp_collector import Collector, running_collector

from tokenmill.model.loading import DEFAULT_MODEL_FILE, default_gguf


def ci_script(path: Path) -> types.ModuleType:
    """One of .ci/'s generator scripts, loaded as a module (it is a script, not part of a package)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_llama_config():  # the shape design.md §8 found to give varied greedy tokens
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
        initializer_range=0.3, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved tiny random LlamaForCausalLM with SmolLM2's tokenizer."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    target = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    model.save_pretrained(target)
    gguf = default_gguf()
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=DEFAULT_MODEL_FILE).save_pretrained(target)
    return target


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free now and not handed out before in this run: a test that takes two (a server's and
    the shards' meeting port) must not get the same one twice before either is bound."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


class RunningServer:
    def __init__(self, process: subprocess.Popen, port: int, log_path: Path) -> None:
        self.process = process
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.backend = ""

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()


def launch_server(args: list[str], tmp_path: Path, env: dict[str, str] | None = None,
                  python: str = sys.executable, new_session: bool = False) -> RunningServer:
    """Start ``tokenmill launch`` (with ``python``) on a free loopback port, without waiting for it;
    ``new_session``: in a session (and process group) of its own, for tests that signal the whole group."""
    port = free_port()
    log_path = tmp_path / f"server-{port}.log"
    # Servers run their forward eagerly unless a test asks: compiling costs each start tens of seconds.
    full_env = {**os.environ, "TOKENMILL_DISABLE_PLUGIN_AUTOLOAD": "1", "COMPILE_MODEL": "false", **(env or {})}
    command = [python, "-m", "tokenmill", "launch", "--hostname", "127.0.0.1", "--port", str(port), *args]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                   start_new_session=new_session)
    return RunningServer(process, port, log_path)


def start_server(args: list[str], tmp_path: Path, env: dict[str, str] | None = None, ready_timeout: float = 300.0,
                 python: str = sys.executable, new_session: bool = False) -> RunningServer:
    """:func:`launch_server`, then wait for /health."""
    server = launch_server(args, tmp_path, env, python, new_session)
    process = server.process
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"server not healthy after {ready_timeout}s:\n{server.log()}")


@pytest.fixture(scope="module", params=[pytest.param("transformers", marks=pytest.mark.slow), "paged"])
def tiny_server(request: pytest.FixtureRequest, tiny_model_dir: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """The real server (uvicorn) on the tiny model, once per backend, with small limits that tests can reach.
    The default run serves the paged backend (auto's choice on CPU); the slow pass adds transformers.
    It runs in float32, as the ``tiny_model`` reference its answers are checked against."""
    server = start_server(
        ["--model-id", str(tiny_model_dir), "--server", "uvicorn", "--max-input-tokens", "512",
         "--max-total-tokens", "1024", "--max-concurrent-requests", "16", "--backend", request.param,
         "--dtype", "float32"],
        tmp_path_factory.mktemp("server"),
    )
    server.backend = request.param
    yield server
    server.stop()


@pytest.fixture
def collector() -> Iterator[Collector]:
    """A stand-in OTLP/HTTP trace collector on loopback (skips without the otlp extra)."""
    pytest.importorskip("opentelemetry.sdk")
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter")
    with running_collector() as running:
        yield running


def running_site_dirs() -> list[str]:
    """The site-packages directories of the interpreter running the tests, a venv's or a system install's."""
    dirs = site.getsitepackages()
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [d for d in dict.fromkeys(dirs) if Path(d).is_dir()]


def overlay_venv(venv: Path) -> Path:
    """A fresh venv over the running interpreter's packages, and its python.

    ``venv --system-site-packages`` would see the *base* interpreter's packages, which is not where a
    user's venv keeps tokenmill and torch; instead a .pth file in the new venv's own site-packages adds
    the running interpreter's site directories with :func:`site.addsitedir`, so their .pth files (an
    editable install's finder) run too. They come after the venv's own directory: what is pip-installed
    into the venv takes precedence."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    own = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    line = "import site; " + "; ".join(f"site.addsitedir({d!r})" for d in running_site_dirs())
    (Path(own) / "zz-tokenmill-tests-overlay.pth").write_text(line + "\n")
    return python
