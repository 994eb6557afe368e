"""Throughput of continuous batching: 16 concurrent greedy requests against the same 16 sent one at a time.

Starts ``tokenmill launch`` on the default model (SmolLM2-135M-Instruct) on a free
loopback port, warms it up, then runs both loads in the same process and prints
generated tokens per second for each and their ratio. Usage:

    python bench/concurrency.py [--requests 16] [--new-tokens 64] [--model-id PATH]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

TOPICS = ["a lighthouse keeper", "the history of bread", "a robot learning to paint", "the water cycle",
          "a city under the sea", "how bridges stand up", "a dragon who hates gold", "the first day of school",
          "volcanoes", "a detective cat", "the invention of the telescope", "a journey across a desert",
          "why the sky is blue", "a chess tournament", "a garden on Mars", "the life of a honeybee"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def chat_prompts(count: int) -> list[str]:
    template = "<|im_start|>user\nWrite a long, detailed story about {}.<|im_end|>\n<|im_start|>assistant\n"
    return [template.format(TOPICS[i % len(TOPICS)]) for i in range(count)]


def start(launch_args: list[str], log) -> tuple[subprocess.Popen, str]:
    """Start ``tokenmill launch`` (uvicorn) on a free loopback port; wait until /health says 200."""
    port = free_port()
    command = [sys.executable, "-m", "tokenmill", "launch", "--server", "uvicorn", "--hostname", "127.0.0.1",
               "--port", str(port), *launch_args]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server exited with {process.returncode}; see {log.name}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit("server did not become healthy")


def one(url: str, prompt: str, new_tokens: int) -> tuple[int, float]:
    started = time.perf_counter()
    response = httpx.post(url + "/generate", timeout=600, json={
        "inputs": prompt, "parameters": {"max_new_tokens": new_tokens, "details": True}})
    response.raise_for_status()
    return response.json()["details"]["generated_tokens"], time.perf_counter() - started


def run_load(url: str, prompts: list[str], new_tokens: int, concurrency: int) -> dict[str, float]:
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: one(url, p, new_tokens), prompts))
    wall = time.perf_counter() - started
    tokens = sum(r[0] for r in results)
    latencies = sorted(r[1] for r in results)
    return {"tokens": tokens, "wall": wall, "tokens_per_s": tokens / wall,
            "p50": statistics.median(latencies), "max": latencies[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--model-id", default=None)
    args = parser.parse_args()
    prompts = chat_prompts(args.requests)
    with tempfile.NamedTemporaryFile("wb", prefix="tokenmill-bench-", suffix=".log", delete=False) as log:
        process, url = start(["--model-id", args.model_id] if args.model_id else [], log)
        try:
            one(url, prompts[0], 8)  # warm the path once more
            sequential = run_load(url, prompts, args.new_tokens, concurrency=1)
            concurrent = run_load(url, prompts, args.new_tokens, concurrency=args.requests)
        finally:
            process.terminate()
            process.wait(30)
    print(f"model: {args.model_id or 'default (SmolLM2-135M-Instruct)'}, {args.requests} greedy requests, "
          f"max_new_tokens={args.new_tokens}, torch threads={os.cpu_count()} cores")
    print(f"{'load':<12} {'tokens':>7} {'wall s':>8} {'tok/s':>8} {'p50 s':>7} {'max s':>7}")
    for name, result in (("sequential", sequential), ("concurrent", concurrent)):
        print(f"{name:<12} {result['tokens']:>7} {result['wall']:>8.2f} {result['tokens_per_s']:>8.1f} "
              f"{result['p50']:>7.2f} {result['max']:>7.2f}")
    print(f"concurrent / sequential throughput: {concurrent['tokens_per_s'] / sequential['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
