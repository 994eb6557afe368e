"""bfloat16 against float32 on the default model (SmolLM2-135M-Instruct): what the cheaper dtype costs in quality.

For each ``--dtypes`` entry, against float32 as the reference, on the default model or ``--model``
(an HF checkpoint directory), every dtype given explicitly (never tokenmill's "auto"):
- on the fixed text set of ``bench.quant`` (the longer prompts of the prompt set, teacher-forced,
  transformers' model loaded from the checkpoint in that dtype): perplexity and its difference from
  float32's (the goal: within 1 %), and top-1 agreement of the next-token choice with float32 at
  every position;
- on the whole prompt set, greedily through the engine as ``tokenmill launch`` builds it (paged
  backend, end-of-sequence ignored, ``--new-tokens`` each, as ``bench.agreement``): the prompts whose
  tokens are identical to float32's, and the share of tokens before each prompt's first difference.

    python -m bench dtype [--dtypes bfloat16 float16] [--new-tokens 64] [--model DIR]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.agreement import first_difference, greedy_tokens
from bench.engine import prompt_set
from bench.quant import agreement, perplexity, teacher_forced, text_set

ABOUT = "bfloat16 against float32 on SmolLM2: perplexity, top-1 and greedy agreement"
"""What ``python -m bench --help`` says the scenario runs."""
REFERENCE = "float32"
GOAL_PERCENT = 1.0


def say(started: float, message: str) -> None:
    elapsed = int(time.monotonic() - started)
    print(f"[{elapsed // 60:02d}:{elapsed % 60:02d}] {message}", file=sys.stderr, flush=True)


def checkpoint(model: str | None) -> Path:
    """The HF checkpoint directory: ``model``, or the default model's GGUF converted to float32 (once)."""
    from tokenmill.model.loading import converted_gguf, default_gguf

    return Path(model).resolve() if model else converted_gguf(Path(default_gguf()))


def quality(path: Path, dtype: str, texts: list[str]) -> tuple[list[torch.Tensor], Any]:
    """Teacher-forced next-token log-probabilities of ``texts``, the model loaded in ``dtype``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="sdpa").eval()
    logprobs = teacher_forced(model, tokenizer, texts)
    del model
    gc.collect()
    return logprobs, tokenizer


def greedy(reference: list[list[int]], other: list[list[int]]) -> tuple[int, float]:
    """Prompts whose greedy tokens are identical, and the share of tokens before the first difference."""
    identical = sum(a == b for a, b in zip(reference, other))
    same = sum(first_difference(a, b) for a, b in zip(reference, other))
    return identical, same / sum(len(a) for a in reference)


def parser() -> argparse.ArgumentParser:
    """``python -m bench dtype``'s command line."""
    result = argparse.ArgumentParser(prog="python -m bench dtype", description=__doc__.splitlines()[0])
    result.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float16"],
                        help="compared with float32, the reference")
    result.add_argument("--model", default=None, help="an HF checkpoint directory instead of the default model")
    result.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt")
    return result


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    started = time.monotonic()
    path = checkpoint(args.model)
    model_id = str(path) if args.model else None  # None: what tokenmill loads when no model id is given
    texts = text_set()
    prompts = [p["messages"] for p in prompt_set()["prompts"]]
    rows: dict[str, dict[str, Any]] = {}
    reference_logprobs: list[torch.Tensor] = []
    reference_tokens: list[list[int]] = []
    for dtype in [REFERENCE, *args.dtypes]:
        say(started, f"{dtype}: teacher-forced on {len(texts)} texts")
        logprobs, tokenizer = quality(path, dtype, texts)
        say(started, f"{dtype}: greedy on {len(prompts)} prompts, {args.new_tokens} tokens each, on the engine")
        tokens = greedy_tokens(dtype, prompts, args.new_tokens, model_id)
        gc.collect()
        if dtype == REFERENCE:
            reference_logprobs, reference_tokens = logprobs, tokens
        identical, before = greedy(reference_tokens, tokens)
        rows[dtype] = {"perplexity": perplexity(logprobs, tokenizer, texts),
                       "agreement": agreement(logprobs, reference_logprobs),
                       "identical": identical, "before": before}
    base = rows[REFERENCE]["perplexity"]
    positions = sum(len(r) for r in reference_logprobs)
    name = "SmolLM2-135M-Instruct" if args.model is None else path.name
    print(f"{name} on {'CUDA' if torch.cuda.is_available() else 'CPU'}; quality teacher-forced on {positions} "
          f"positions of {len(texts)} texts; greedy on the engine (paged backend), {len(prompts)} prompts, "
          f"{args.new_tokens} new tokens each:\n")
    print("| dtype | perplexity | against fp32 | top-1 agreement per position | greedy: prompts identical "
          "| greedy: tokens before the first difference |")
    print("|" + " --- |" * 6)
    for dtype, row in rows.items():
        change = "—" if dtype == REFERENCE else f"{100 * (row['perplexity'] / base - 1):+.2f} %"
        print(f"| {dtype} | {row['perplexity']:.2f} | {change} | {100 * row['agreement']:.1f} % | "
              f"{row['identical']}/{len(prompts)} | {100 * row['before']:.1f} % |")
    print()
    for dtype in args.dtypes:
        off = 100 * abs(rows[dtype]["perplexity"] / base - 1)
        print(f"goal: {dtype} perplexity within {GOAL_PERCENT:.0f} % of float32's: "
              f"{'met' if off <= GOAL_PERCENT else 'missed'} ({off:.2f} %)")
    say(started, "done")


if __name__ == "__main__":
    main()
