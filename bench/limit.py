"""The limit a server works against: the model's own batched decode, no server around it.

For each batch size, prefill ``batch`` random 64-token prompts into a transformers
DynamicCache, then time ``steps`` greedy decode steps of the whole batch (one forward
with the cache per step). Output tokens/s = batch × steps / time. Also times a 2048²
matmul: its rate over the model's matmul FLOPs per token is the arithmetic bound.

    python -m bench.limit --model DIR --batch 1 8 32 64 [--json]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch


def matmul_gflops(size: int = 2048, dtype: torch.dtype = torch.float32, repeats: int = 10) -> float:
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    a @ b
    started = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - started) / 1e9


def gflop_per_token(model: Any) -> float:
    """Twice the weights of every linear layer, the LM head included: the multiply-adds one
    token costs in matmuls (attention over the context and the embedding lookup left out)."""
    return 2 * sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)) / 1e9


def gflop_per_prompt_token(model: Any) -> float:
    """:func:`gflop_per_token` without the LM head: a prompt position computes no logits (only the last
    one does, which its output token already counts)."""
    head = model.get_output_embeddings()
    return gflop_per_token(model) - (2 * head.weight.numel() / 1e9 if head is not None else 0.0)


@torch.no_grad()
def decode_tokens_per_s(model: Any, batch: int, steps: int = 32, prompt_tokens: int = 64) -> dict[str, float]:
    from transformers import DynamicCache

    generator = torch.Generator().manual_seed(batch)
    ids = torch.randint(100, model.config.vocab_size - 100, (batch, prompt_tokens), generator=generator)
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits
    next_ids = logits.argmax(-1)
    model(input_ids=next_ids, cache=cache, use_cache=True)  # one untimed step: allocator warm-up
    started = time.perf_counter()
    for _ in range(steps):
        next_ids = model(input_ids=next_ids, cache=cache, use_cache=True).logits.argmax(-1)
    elapsed = time.perf_counter() - started
    return {"batch": batch, "tokens_per_s": batch * steps / elapsed, "step_ms": 1000 * elapsed / steps}


def parser() -> argparse.ArgumentParser:
    """``python -m bench.limit``'s command line."""
    result = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    result.add_argument("--model", required=True)
    result.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    result.add_argument("--steps", type=int, default=32)
    result.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return result


def main() -> None:
    from transformers import AutoModelForCausalLM

    args = parser().parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    result = {"threads": torch.get_num_threads(), "matmul_gflops_fp32": matmul_gflops(),
              "matmul_gflops_bf16": matmul_gflops(dtype=torch.bfloat16),
              "gflop_per_token": gflop_per_token(model),
              "gflop_per_prompt_token": gflop_per_prompt_token(model),
              "decode": [decode_tokens_per_s(model, batch, args.steps) for batch in args.batch]}
    result["arithmetic_bound_tokens_per_s"] = result["matmul_gflops_fp32"] / result["gflop_per_token"]
    if args.json:
        print(json.dumps(result))
        return
    print(f"torch threads {result['threads']}; 2048² matmul: fp32 {result['matmul_gflops_fp32']:.0f} GFLOP/s, "
          f"bf16 {result['matmul_gflops_bf16']:.0f} GFLOP/s; {result['gflop_per_token']:.3f} GFLOP a token, so fp32 "
          f"decode stays under {result['arithmetic_bound_tokens_per_s']:.0f} tokens/s")
    for row in result["decode"]:
        print(f"batch {row['batch']:>3}: {row['tokens_per_s']:7.1f} tokens/s ({row['step_ms']:.1f} ms a step)")


if __name__ == "__main__":
    main()
