"""How often bfloat16 picks the same greedy tokens as float32, over the bench prompt set.

Runs every prompt of ``bench/prompts/v1.json`` through two engines built as ``tokenmill
launch`` builds them (the default model, the paged backend), one per dtype, greedily for
``--new-tokens`` tokens with end-of-sequence ignored, and compares the two token lists of
each prompt up to their first difference (after it the contexts differ, so later
positions say nothing).

    python -m bench.agreement [--dtype bfloat16] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
from typing import Any

from bench.engine import chat_ids, prompt_set, start_ignoring_eos


def greedy_tokens(dtype: str | None, prompts: list[list[dict[str, str]]], new_tokens: int,
                  model_id: str | None) -> list[list[int]]:
    from tokenmill.config import Config
    from tokenmill.engine.sequence import GenerationRequest, SamplingParams, TokenEvent

    # End-of-sequence ignored: every prompt runs to new_tokens, so the lists compare position by position.
    started = start_ignoring_eos(Config(model_id=model_id, backend="paged", dtype=dtype))
    engine = started.engine
    tokenizer = started.loaded.tokenizer
    outputs: list[list[int]] = [[] for _ in prompts]
    for row, messages in enumerate(prompts):
        ids = chat_ids(tokenizer, messages)
        sink: Any = (lambda event, row=row:
                     outputs[row].append(event.token.id) if isinstance(event, TokenEvent) else None)
        engine.submit(GenerationRequest("", ids, new_tokens, SamplingParams()), sink)
    while any(len(out) < new_tokens for out in outputs):
        engine.run_once()
    return outputs


def generate_tokens(dtype: str, prompts: list[list[dict[str, str]]], new_tokens: int) -> list[list[int]]:
    """The same prompts through transformers' own ``model.generate()``, one at a time."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenmill.model.loading import converted_gguf, default_gguf

    path = converted_gguf(default_gguf())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    outputs = []
    for messages in prompts:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
        outputs.append(out[0, ids["input_ids"].shape[1]:].tolist())
    return outputs


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def parser() -> argparse.ArgumentParser:
    """``python -m bench.agreement``'s command line."""
    result = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    result.add_argument("--dtype", default="bfloat16")
    result.add_argument("--new-tokens", type=int, default=64)
    result.add_argument("--model-id", default=None)
    result.add_argument("--generate", action="store_true",
                        help="also compare each dtype with model.generate() of the default model")
    return result


def main() -> None:
    args = parser().parse_args()
    data = prompt_set()["prompts"]
    prompts = [p["messages"] for p in data]
    reference = greedy_tokens("float32", prompts, args.new_tokens, args.model_id)
    other = greedy_tokens(args.dtype, prompts, args.new_tokens, args.model_id)
    agreed = 0
    for prompt, a, b in zip(data, reference, other):
        same = first_difference(a, b)
        agreed += same
        print(f"{prompt['id']:<12} {'identical' if same == args.new_tokens else f'first differs at token {same}'}")
    identical = sum(a == b for a, b in zip(reference, other))
    total = args.new_tokens * len(prompts)
    print(f"{args.dtype} against float32: {identical}/{len(prompts)} prompts identical; "
          f"{agreed}/{total} tokens ({100 * agreed / total:.1f} %) before the first difference")
    if args.generate:
        generated = {}
        for dtype, ours in (("float32", reference), (args.dtype, other)):
            theirs = generated[dtype] = generate_tokens(dtype, prompts, args.new_tokens)
            print(f"{dtype}: tokenmill against model.generate(): " + agreement(ours, theirs))
        print(f"model.generate() in {args.dtype} against float32: "
              + agreement(generated[args.dtype], generated["float32"]))


def agreement(first: list[list[int]], second: list[list[int]]) -> str:
    same = sum(first_difference(a, b) for a, b in zip(first, second))
    total = sum(len(a) for a in first)
    return (f"{sum(a == b for a, b in zip(first, second))}/{len(first)} prompts identical, "
            f"{100 * same / total:.1f} % of tokens before the first difference")


if __name__ == "__main__":
    main()
