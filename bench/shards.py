"""``--num-shard 1`` against ``--num-shard 2`` on SmolLM2: resident memory per rank and tokens/s.

Starts tokenmill (paged backend) once per shard count, reads each rank's resident memory
after warm-up, and drives it with the prompt set through ``/generate_stream`` at each
concurrency level.

    python -m bench shards [--concurrency 1 8] [--new-tokens 64] [--requests 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from bench.common import load_prompts
from bench.loadgen import run_load
from bench.peers import free_port

ABOUT = "--num-shard 1 against 2, memory per rank and tokens/s"
"""What ``python -m bench --help`` says the scenario runs."""


def start(shards: int, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "tokenmill", "launch", "--server", "uvicorn", "--port", str(port),
               "--hostname", "127.0.0.1", "--backend", "paged", "--num-shard", str(shards),
               "--master-port", str(free_port())]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "TOKENMILL_DISABLE_PLUGIN_AUTOLOAD": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"--num-shard {shards} exited: {log_path.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"--num-shard {shards} not healthy in 300 s")


def parser() -> argparse.ArgumentParser:
    """``python -m bench shards``'s command line."""
    result = argparse.ArgumentParser(prog="python -m bench shards", description=__doc__.splitlines()[0])
    result.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    result.add_argument("--new-tokens", type=int, default=64)
    result.add_argument("--requests", type=int, default=16)
    return result


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoTokenizer

    from tokenmill.model.loading import converted_gguf, default_gguf

    args = parser().parse_args(argv)
    prompts, _ = load_prompts(AutoTokenizer.from_pretrained(converted_gguf(default_gguf())))
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for shards in (1, 2):
            process, url = start(shards, Path(scratch) / f"shards-{shards}.log")
            try:
                ranks = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
                memory = [p.memory_info().rss / 2**20 for p in ranks]
                speeds = []
                for level in args.concurrency:
                    report = asyncio.run(run_load(url, "tgi", prompts, concurrency=level,
                                                  requests=max(args.requests, level), max_new_tokens=args.new_tokens,
                                                  time_bound_s=600))
                    speeds.append(report.tokens_per_s)
                rows.append((shards, memory, speeds))
            finally:
                process.terminate()
                process.wait(30)
    levels = " | ".join(f"tokens/s @{c}" for c in args.concurrency)
    print(f"| shards | resident MB per rank | {levels} |")
    print("|" + " --- |" * (2 + len(args.concurrency)))
    for shards, memory, speeds in rows:
        print(f"| {shards} | {' / '.join(f'{m:.0f}' for m in memory)} | "
              + " | ".join(f"{s:.1f}" for s in speeds) + " |")


if __name__ == "__main__":
    main()
