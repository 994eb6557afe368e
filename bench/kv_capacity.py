"""KV memory of the paged backend against the transformers backend, in-process.

Eight concurrent sequences of 512 tokens (prompts of 96..480 tokens, each run to 512)
on the default model (SmolLM2-135M-Instruct): the peak KV memory of each backend, and so
how many such sequences each holds within one KV budget. Throughput of the two backends
over HTTP is in the harness (``python -m bench``). Usage:

    python -m bench.kv_capacity [--budget-mib 1024]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

BACKENDS = ("transformers", "paged")


def measure(budget_mib: int) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from engine_helpers import Collector, build_engine

    from tokenmill.engine.sequence import GenerationRequest, SamplingParams
    from tokenmill.model.loading import converted_gguf, default_gguf

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
            peak = max(peak, engine.kv_usage()["bytes"])
            held = max(held, engine.batch_size)
        peaks[backend] = peak
        print(f"{backend}: held {held} sequences at once, KV peak {peak / 2**20:.1f} MiB, "
              f"preemptions {engine.preemptions}")
    budget = budget_mib * 2**20
    print(f"\nConcurrent 512-token sequences (prompts 96..480 tokens) within a {budget_mib} MiB KV budget:")
    for backend in BACKENDS:
        per_sequence = peaks[backend] / len(prompt_lengths)
        print(f"  {backend:<13} {int(budget // per_sequence):>5}   "
              f"({per_sequence / 2**20:.1f} MiB per sequence at peak)")


def parser() -> argparse.ArgumentParser:
    """``python -m bench.kv_capacity``'s command line."""
    result = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    result.add_argument("--budget-mib", type=int, default=1024)
    return result


def main() -> None:
    measure(parser().parse_args().budget_mib)


if __name__ == "__main__":
    main()
