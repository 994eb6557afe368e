"""The paged backend against the transformers backend on the default model (SmolLM2-135M-Instruct), CPU.

Part 1, over HTTP: output tokens/s at 1, 8 and 32 concurrent greedy requests of 64 new
tokens, one server per backend started in turn, and each server's peak resident memory.
Part 2, in-process: KV memory at its peak for the same 8 concurrent sequences of 512
tokens (prompts of different lengths), and so how many such sequences each backend
holds within one KV budget. Usage:

    python bench/backends.py [--concurrency 1 8 32] [--new-tokens 64] [--budget-mib 1024]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from concurrency import chat_prompts, one, start  # noqa: E402

BACKENDS = ("transformers", "paged")


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def throughput(url: str, concurrency: int, new_tokens: int) -> float:
    prompts = chat_prompts(max(concurrency, 3))
    rounds = 1 if concurrency > 1 else 3  # a single request is short: average three, one after another
    started = time.perf_counter()
    tokens = 0
    for round_index in range(rounds):
        batch = prompts[round_index : round_index + concurrency]
        with ThreadPoolExecutor(concurrency) as pool:
            tokens += sum(r[0] for r in pool.map(lambda p: one(url, p, new_tokens), batch))
    return tokens / (time.perf_counter() - started)


def part_one(levels: list[int], new_tokens: int) -> None:
    results: dict[str, dict[int, float]] = {}
    peaks: dict[str, float] = {}
    for backend in BACKENDS:
        with tempfile.NamedTemporaryFile("wb", prefix=f"tokenmill-{backend}-", suffix=".log", delete=False) as log:
            process, url = start(["--backend", backend, "--max-batch-total-tokens", "65536"], log)
            try:
                one(url, chat_prompts(1)[0], 8)
                results[backend] = {c: throughput(url, c, new_tokens) for c in levels}
                peaks[backend] = peak_rss_mib(process.pid)
            finally:
                process.terminate()
                process.wait(30)
    print(f"\nOutput tokens/s, greedy, {new_tokens} new tokens per request (SmolLM2-135M, fp32, CPU)")
    print(f"{'concurrent':>10} " + " ".join(f"{b:>13}" for b in BACKENDS) + "   paged/transformers")
    for c in levels:
        row = [results[b][c] for b in BACKENDS]
        print(f"{c:>10} " + " ".join(f"{v:>13.1f}" for v in row) + f"   {row[1] / row[0]:.2f}x")
    print("peak RSS MiB " + " ".join(f"{peaks[b]:>13.0f}" for b in BACKENDS))


def part_two(budget_mib: int) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from engine_helpers import Collector, build_engine

    from tokenmill.loading import converted_gguf, default_gguf
    from tokenmill.sequence import GenerationRequest, SamplingParams

    path = converted_gguf(default_gguf())
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt_lengths = [96, 160, 224, 288, 352, 416, 448, 480]  # each sequence ends at 512 tokens
    peaks: dict[str, int] = {}
    for backend in BACKENDS:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        engine = build_engine(model, tokenizer, backend=backend, ignore_eos=True, max_batch_total_tokens=8 * 512 + 512)
        sinks = [Collector() for _ in prompt_lengths]
        for length, sink in zip(prompt_lengths, sinks):
            ids = torch.randint(100, 40000, (length,), generator=torch.Generator().manual_seed(length)).tolist()
            engine.submit(GenerationRequest("", ids, 512 - length, SamplingParams()), sink)
        peak = held = 0
        while not all(s.done for s in sinks):
            engine.run_once()
            peak = max(peak, engine.runner.kv_usage()["bytes"])
            held = max(held, engine.batch_size)
        peaks[backend] = peak
        print(f"{backend}: held {held} sequences at once, KV peak {peak / 2**20:.1f} MiB, preemptions {engine.preemptions}")
    budget = budget_mib * 2**20
    print(f"\nConcurrent 512-token sequences (prompts 96..480 tokens) within a {budget_mib} MiB KV budget:")
    for backend in BACKENDS:
        per_sequence = peaks[backend] / len(prompt_lengths)
        print(f"  {backend:<13} {int(budget // per_sequence):>5}   ({per_sequence / 2**20:.1f} MiB per sequence at peak)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--budget-mib", type=int, default=1024)
    parser.add_argument("--skip-http", action="store_true")
    args = parser.parse_args()
    if not args.skip_http:
        part_one(args.concurrency, args.new_tokens)
    part_two(args.budget_mib)


if __name__ == "__main__":
    main()
