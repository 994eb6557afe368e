"""Hub downloads against a stand-in hub on loopback: a model by hub id is downloaded into the cache
(only the files loading reads), served, and loaded again offline; --revision, HF_TOKEN and adapters by
hub id reach the hub as huggingface_hub asks it; failures are one line naming the repository."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from conftest import free_port, launch_server, start_server

from tokenmill.model.loading import ModelLoadError, Stages, resolve_checkpoint

MAIN = "a" * 40
SLIM = "b" * 40
TOKEN = "hf_stand_in_token"
PROMPT = "The capital of France is"
NOT_FETCHED = ("pytorch_model.bin", "onnx/model.onnx", "README.md")
"""Files the stand-in repository also holds and that loading must not fetch: .bin weights beside
safetensors, a subfolder, a model card."""


@dataclass
class Repo:
    files: dict[str, bytes]
    branches: dict[str, str] = field(default_factory=lambda: {"main": MAIN, "slim": SLIM})
    token: str | None = None
    """A gated repository: its files answer only ``Authorization: Bearer <token>``."""
    delay: float = 0.0
    """A slow link: seconds before each file's answer."""

    def commit_of(self, revision: str) -> str | None:
        return self.branches.get(revision) or (revision if revision in self.branches.values() else None)


@dataclass
class Seen:
    method: str
    path: str
    authorization: str | None


class StandInHub(ThreadingHTTPServer):
    """The parts of the hub's HTTP API that huggingface_hub 2.4's snapshot_download uses: model info,
    the file tree, and HEAD/GET on ``/{repo}/resolve/{revision}/{file}`` with its X-Repo-Commit, ETag and
    X-Linked-* headers; errors carry X-Error-Code as the hub's do. It records every request."""

    daemon_threads = True

    def __init__(self, repos: dict[str, Repo]) -> None:
        super().__init__(("127.0.0.1", 0), HubHandler)
        self.repos = repos
        self.seen: list[Seen] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def paths(self, method: str | None = None) -> list[str]:
        return [seen.path for seen in self.seen if method in (None, seen.method)]


class HubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: StandInHub

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self.answer(with_body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self.answer(with_body=False)

    def answer(self, with_body: bool) -> None:
        path = urlsplit(self.path).path
        self.server.seen.append(Seen(self.command, path, self.headers.get("Authorization")))
        parts = [unquote(part) for part in path.strip("/").split("/")]
        api = parts[:2] == ["api", "models"]
        repo_id = "/".join(parts[2:4] if api else parts[:2])
        rest = parts[4:] if api else parts[2:]
        repo = self.server.repos.get(repo_id)
        if repo is None:
            self.error(404, "RepoNotFound", "Repository not found")
            return
        revision = rest[1] if len(rest) > 1 else "main"
        commit = repo.commit_of(revision)
        if commit is None:
            self.error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return
        if api and rest[:1] == ["tree"]:
            entries = [{"type": "file", "path": name, "size": len(data), "oid": git_oid(data)}
                       for name, data in repo.files.items()]
            self.send_json(entries, with_body)
            return
        if api:  # model info, of the default branch or of /revision/<rev>
            siblings = [{"rfilename": name, "size": len(data), "blobId": git_oid(data)}
                        for name, data in repo.files.items()]
            self.send_json({"id": repo_id, "sha": commit, "private": False,
                            "gated": "manual" if repo.token else False, "siblings": siblings}, with_body)
            return
        if rest[:1] != ["resolve"]:
            self.error(404, "EntryNotFound", "no such route")
            return
        time.sleep(repo.delay)
        if repo.token and self.headers.get("Authorization") != f"Bearer {repo.token}":
            self.error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access "
                                         "to it and be authenticated to access it. Please log in.")
            return
        name = "/".join(rest[2:])
        if name not in repo.files:
            self.error(404, "EntryNotFound", f"{name} does not exist", commit)
            return
        data = repo.files[name]
        headers = {"X-Repo-Commit": commit, "ETag": f'"{git_oid(data)}"', "Content-Length": str(len(data)),
                   "Content-Type": "application/octet-stream"}
        if name.endswith(".safetensors"):  # what the hub says of LFS files
            headers |= {"X-Linked-Etag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Linked-Size": str(len(data))}
        self.send(200, headers, data if with_body else b"")

    def send_json(self, value: object, with_body: bool) -> None:
        body = json.dumps(value).encode()
        self.send(200, {"Content-Type": "application/json", "Content-Length": str(len(body))},
                  body if with_body else b"")

    def error(self, status: int, code: str, message: str, commit: str | None = None) -> None:
        body = json.dumps({"error": message}).encode()
        headers = {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json",
                   "Content-Length": str(len(body))}
        if commit:
            headers["X-Repo-Commit"] = commit
        self.send(status, headers, body if self.command != "HEAD" else b"")

    def send(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)


def git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # noqa: S324 - git's object id, not security


@pytest.fixture(scope="module")
def model_files(tiny_model_dir: Path) -> dict[str, bytes]:
    files = {path.name: path.read_bytes() for path in tiny_model_dir.iterdir() if path.is_file()}
    return files | {"pytorch_model.bin": b"not to be fetched", "onnx/model.onnx": b"nor this", "README.md": b"# tiny"}


@pytest.fixture
def stand_in(model_files: dict[str, bytes]) -> Iterator[StandInHub]:
    hub = StandInHub({"org/tiny": Repo(model_files), "org/gated": Repo(model_files, token=TOKEN)})
    thread = threading.Thread(target=hub.serve_forever, daemon=True)
    thread.start()
    yield hub
    hub.shutdown()
    hub.server_close()


@pytest.fixture
def hub_client(stand_in: StandInHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process's hub client pointed at the stand-in, online, with no token of its own; the hub cache.
    (The client reads HF_ENDPOINT once, at import, into these two constants; servers get it as HF_ENDPOINT.)"""
    import huggingface_hub.constants as constants

    for variable in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", stand_in.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        stand_in.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    return tmp_path / "hub"


def server_env(stand_in: StandInHub, home: Path, monkeypatch: pytest.MonkeyPatch, **extra: str) -> dict[str, str]:
    """A server's hub settings: the stand-in's address and a fresh HF_HOME (nothing inherited overrides it)."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN",
                     "TRANSFORMERS_OFFLINE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(variable, raising=False)
    return {"HF_ENDPOINT": stand_in.url, "HF_HOME": str(home), "HF_HUB_OFFLINE": "0", **extra}


def greedy_text(url: str) -> str:
    import httpx

    answer = httpx.post(f"{url}/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 8}},
                        timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()["generated_text"]


def test_a_hub_id_is_downloaded_served_and_then_loaded_offline_from_the_cache(stand_in, tmp_path, monkeypatch):
    home = tmp_path / "hf"
    args = ["--model-id", "org/tiny", "--server", "uvicorn", "--max-total-tokens", "512"]
    server = start_server(args, tmp_path, env=server_env(stand_in, home, monkeypatch))
    try:
        import httpx

        info = httpx.get(f"{server.url}/info", timeout=10).json()
        online_text = greedy_text(server.url)
    finally:
        server.stop()
    stages = [stage["stage"] for stage in info["load_stages"]]
    assert stages[:3] == ["resolving", "downloading", "loading weights"], stages
    assert info["model_id"] == "org/tiny"
    snapshot = home / "hub" / "models--org--tiny" / "snapshots" / MAIN
    assert sorted(path.name for path in snapshot.iterdir()) == sorted(
        name for name in stand_in.repos["org/tiny"].files if name not in NOT_FETCHED)
    assert (home / "hub" / "models--org--tiny" / "refs" / "main").read_text() == MAIN
    fetched = stand_in.paths("GET")
    assert f"/org/tiny/resolve/{MAIN}/model.safetensors" in fetched
    assert not [path for path in fetched if path.endswith(NOT_FETCHED)], "safetensors only, top level only"
    assert "downloading org/tiny: 6/6 files" in server.log()

    stand_in.seen.clear()
    server = start_server(args, tmp_path, env=server_env(stand_in, home, monkeypatch, HF_HUB_OFFLINE="1"))
    try:
        assert greedy_text(server.url) == online_text
    finally:
        server.stop()
    assert stand_in.seen == [], "offline, the hub is never asked"


def test_the_revision_reaches_the_hub_and_names_the_snapshot(stand_in, hub_client):
    stages = Stages()
    name, path = resolve_checkpoint("org/tiny", "slim", stages, hub_cache=str(hub_client))
    assert (name, path) == ("org/tiny", hub_client / "models--org--tiny" / "snapshots" / SLIM)
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    assert [stage["stage"] for stage in stages.done] == ["resolving", "downloading"]
    assert "/api/models/org/tiny/revision/slim" in stand_in.paths("GET")
    assert f"/org/tiny/resolve/{SLIM}/model.safetensors" in stand_in.paths("GET")
    assert not [path for path in stand_in.paths() if f"/{MAIN}/" in path], "nothing of main is fetched"
    assert (hub_client / "models--org--tiny" / "refs" / "slim").read_text() == SLIM


@pytest.mark.parametrize("model_id, revision, cause", [
    ("org/nothing", None, "no such repository"),
    ("org/tiny", "v9", "has no revision 'v9'"),
])
def test_a_failed_download_is_one_line_naming_the_repository_the_endpoint_and_the_cause(
        stand_in, hub_client, model_id, revision, cause):
    with pytest.raises(ModelLoadError) as raised:
        resolve_checkpoint(model_id, revision, Stages(), hub_cache=str(hub_client))
    message = str(raised.value)
    assert "\n" not in message and repr(model_id) in message and stand_in.url in message and cause in message


def test_a_gated_repository_sends_hf_token_as_a_bearer_token(stand_in, hub_client, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    _, path = resolve_checkpoint("org/gated", None, Stages(), hub_cache=str(hub_client))
    assert (path / "model.safetensors").is_file()
    downloads = [seen for seen in stand_in.seen if "/resolve/" in seen.path]
    assert downloads and {seen.authorization for seen in downloads} == {f"Bearer {TOKEN}"}


def test_without_hf_token_a_gated_model_stops_the_server_with_a_line_that_says_so(stand_in, tmp_path, monkeypatch):
    server = launch_server(["--model-id", "org/gated", "--server", "uvicorn"], tmp_path,
                           env=server_env(stand_in, tmp_path / "hf", monkeypatch))
    try:
        server.process.wait(180)
    finally:
        server.stop()
    log = server.log()
    assert server.process.returncode != 0
    (line,) = [line for line in log.splitlines() if "startup failed" in line]
    assert "HF_TOKEN" in line and "'org/gated'" in line and stand_in.url in line and "gated" in line
    assert "Traceback" not in log


def test_an_adapter_named_by_hub_id_is_downloaded_and_read(stand_in, hub_client, tiny_model_dir, tmp_path):
    pytest.importorskip("peft", reason="the adapter is made with peft")
    import torch
    from transformers import AutoModelForCausalLM

    from bench.lora import write_random_adapter
    from tokenmill.model.adapters import AdapterCache, install

    adapter_dir = write_random_adapter(tmp_path / "made", seed=7, base_dir=tiny_model_dir)
    files = {path.name: path.read_bytes() for path in adapter_dir.iterdir() if path.is_file()}
    stand_in.repos["org/tiny-lora"] = Repo(files)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    cache = AdapterCache(install(model), 2, 16, torch.float32, torch.device("cpu"), base_model_id="org/tiny",
                         hub_cache=str(hub_client))
    started = time.monotonic()
    adapter = cache.register("org/tiny-lora", "org/tiny-lora")
    assert adapter.rank == 8 and adapter.layers and time.monotonic() - started < 30
    assert adapter.path == hub_client / "models--org--tiny-lora" / "snapshots" / MAIN
    assert f"/org/tiny-lora/resolve/{MAIN}/adapter_model.safetensors" in stand_in.paths("GET")


def test_a_hub_that_cannot_be_reached_leaves_the_cached_snapshot_in_use(stand_in, hub_client, caplog, monkeypatch):
    import huggingface_hub.constants as constants

    _, downloaded = resolve_checkpoint("org/tiny", None, Stages(), hub_cache=str(hub_client))
    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setattr(constants, "ENDPOINT", nowhere)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", nowhere + "/{repo_id}/resolve/{revision}/{filename}")
    stages = Stages()
    _, path = resolve_checkpoint("org/tiny", None, stages, hub_cache=str(hub_client))
    assert path == downloaded and [stage["stage"] for stage in stages.done] == ["resolving"]
    assert any("could not be reached" in record.getMessage() and "using the cached snapshot" in record.getMessage()
               for record in caplog.records)


def test_offline_a_model_missing_from_the_cache_is_one_line_that_says_offline(stand_in, hub_client, monkeypatch):
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="'org/tiny' is not a local directory or .gguf file and is not in the "
                                             "local Hugging Face cache .*HF_HUB_OFFLINE=1 is set"):
        resolve_checkpoint("org/tiny", None, Stages(), hub_cache=str(hub_client))
    assert stand_in.seen == []


def test_only_what_loading_reads_is_chosen_and_safetensors_over_bin():
    from tokenmill.model.hub import choose_files

    sharded = ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
               "model-00002-of-00002.safetensors", "model.safetensors.index.json", "consolidated.safetensors",
               "pytorch_model-00001-of-00002.bin", "pytorch_model.bin.index.json", "tokenizer.json",
               "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
               "merges.txt", "vocab.json", "original/consolidated.00.pth", "onnx/model.onnx", "README.md",
               ".gitattributes", "training_args.bin"]
    assert choose_files(sharded) == sorted([
        "config.json", "generation_config.json", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json", "tokenizer.model",
        "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "merges.txt", "vocab.json"])
    assert choose_files(["config.json", "pytorch_model.bin", "training_args.bin", "optimizer.pt"]) == [
        "config.json", "pytorch_model.bin"]
    assert choose_files(["adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"]) == [
        "adapter_config.json", "adapter_model.safetensors"]


def test_a_download_larger_than_its_limit_is_refused_before_any_file_is_fetched(stand_in, hub_client, monkeypatch):
    """POST /adapters fetches at most MAX_ADAPTER_DOWNLOAD_BYTES: what the hub lists is checked first."""
    from tokenmill.model import adapters, hub

    with pytest.raises(hub.HubError, match="more than the limit of"):
        hub.snapshot("org/tiny", None, str(hub_client), max_bytes=1024)
    assert not any("/resolve/" in path for path in stand_in.paths("GET"))
    stand_in.repos["org/big-lora"] = Repo({"adapter_config.json": b"{}", "adapter_model.safetensors": b"0" * 4096})
    monkeypatch.setattr(adapters, "MAX_ADAPTER_DOWNLOAD_BYTES", 1024)
    with pytest.raises(adapters.AdapterError, match="'org/big-lora'.* more than the limit of"):
        adapters.locate("org/big-lora", str(hub_client))
    assert not any("/resolve/" in path for path in stand_in.paths("GET"))
