"""Each quantizer on SmolLM2 against float32: weight memory, speed, and what it costs in quality.

For float32 and each ``--quantize`` method (GPTQ and AWQ read checkpoints this script
packs in their formats, rounded to nearest), on the engine as ``tokenmill launch`` builds
it with end-of-sequence ignored:
- resident weight memory (parameters and buffers, each tensor once);
- output tokens/s with 1 and 32 requests of the prompt set, ``--new-tokens`` each;
- on a fixed text set (the longer prompts of the prompt set, teacher-forced): perplexity,
  and top-1 agreement of the next-token choice with float32 at every position.

    python -m bench quant [--methods int8 int4 ...] [--new-tokens 32] [--concurrency 1 32]
"""

from __future__ import annotations

import argparse
import gc
import math
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.engine import chat_ids, prompt_set, start_ignoring_eos
from bench.steps import run

ABOUT = "each quantizer's memory, speed and quality on SmolLM2, on the engine"
"""What ``python -m bench --help`` says the scenario runs."""
METHODS = ("int8", "int4", "gptq", "awq", "bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4")
GROUP_SIZE = 64


def text_set() -> list[str]:
    """The fixed texts quality is measured on: the medium, long and document prompts' contents."""
    return [p["messages"][-1]["content"] for p in prompt_set()["prompts"] if p["kind"] != "short"]


def teacher_forced(model: Any, tokenizer: Any, texts: list[str]) -> list[torch.Tensor]:
    """Next-token log-probabilities at every position of each text."""
    rows = []
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :1024]
            rows.append(model(ids).logits[0, :-1].float().log_softmax(-1))
    return rows


def perplexity(logprobs: list[torch.Tensor], tokenizer: Any, texts: list[str]) -> float:
    nll, count = 0.0, 0
    for rows, text in zip(logprobs, texts):
        targets = tokenizer(text, return_tensors="pt")["input_ids"][0, 1:1024]
        nll -= rows.gather(1, targets.unsqueeze(1)).sum().item()
        count += len(targets)
    return math.exp(nll / count)


def agreement(logprobs: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    same = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(logprobs, reference))
    return same / sum(len(r) for r in reference)


def checkpoints(source: Path, scratch: Path) -> dict[str, Path]:
    from tokenmill.model.quant_linears import write_packed_checkpoint
    from tokenmill_plugins.quantizers import awq, gptq

    gptq_config = {"quant_method": "gptq", "bits": 4, "group_size": GROUP_SIZE, "desc_act": False, "sym": False}
    awq_config = {"quant_method": "awq", "bits": 4, "group_size": GROUP_SIZE, "zero_point": True, "version": "gemm"}
    return {"gptq": write_packed_checkpoint(source, scratch / "gptq", gptq.pack, gptq_config),
            "awq": write_packed_checkpoint(source, scratch / "awq", awq.pack, awq_config)}


def measure(config: Any, texts: list[str], concurrency: list[int], new_tokens: int,
            reference: list[torch.Tensor] | None) -> dict[str, Any]:
    from tokenmill.model.loading import load_model
    from tokenmill.model.quant_linears import weight_bytes
    from tokenmill.model.quantization import choose_quantizer
    from tokenmill.plugin_manager import build_plugin_manager

    # Quality on the model as loaded (the paged engine takes its attention over afterwards).
    pm = build_plugin_manager(autoload=False)
    loaded = load_model(config.model_id, None, config.dtype, "sdpa",
                        pick_quantizer=lambda path: choose_quantizer(pm, config.quantize, path))
    tokenizer = loaded.tokenizer
    logprobs = teacher_forced(loaded.model, tokenizer, texts)
    row: dict[str, Any] = {"weight_mb": weight_bytes(loaded.model) / 2**20,
                           "perplexity": perplexity(logprobs, tokenizer, texts),
                           "agreement": agreement(logprobs, reference) if reference else 1.0, "logprobs": logprobs}
    del loaded
    started = start_ignoring_eos(config)
    prompts = [chat_ids(tokenizer, p["messages"]) for p in prompt_set()["prompts"]]
    for level in concurrency:
        row[f"tokens_per_s@{level}"] = run(started.engine, prompts, level, new_tokens, None)["tokens_per_s"]
    return row


def parser() -> argparse.ArgumentParser:
    """``python -m bench quant``'s command line."""
    result = argparse.ArgumentParser(prog="python -m bench quant", description=__doc__.splitlines()[0])
    result.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    result.add_argument("--new-tokens", type=int, default=32)
    result.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    return result


def main(argv: list[str] | None = None) -> None:
    from tokenmill.config import Config
    from tokenmill.model.loading import converted_gguf, default_gguf

    args = parser().parse_args(argv)
    source = converted_gguf(default_gguf())
    texts = text_set()
    with tempfile.TemporaryDirectory() as scratch:
        packed = checkpoints(source, Path(scratch))
        rows = {"float32": measure(Config(model_id=str(source), backend="paged", dtype="float32"), texts,
                                   args.concurrency, args.new_tokens, None)}
        reference = rows["float32"]["logprobs"]
        for method in args.methods:
            path = packed.get(method, source)
            flag = None if method in packed else method
            rows[method] = measure(Config(model_id=str(path), backend="paged", quantize=flag, dtype="float32"), texts,
                                   args.concurrency, args.new_tokens, reference)
            gc.collect()
    base = rows["float32"]
    print(f"SmolLM2-135M on CPU, paged backend, {args.new_tokens} new tokens per request, "
          f"{sum(len(r) for r in reference)} positions of {len(texts)} texts for quality:\n")
    levels = " | ".join(f"tokens/s @{c}" for c in args.concurrency)
    print(f"| method | weights MB | share of fp32 | {levels} | top-1 agreement | perplexity |")
    print("|" + " --- |" * (5 + len(args.concurrency)))
    for name, row in rows.items():
        speeds = " | ".join(f"{row[f'tokens_per_s@{c}']:.1f}" for c in args.concurrency)
        print(f"| {name} | {row['weight_mb']:.0f} | {row['weight_mb'] / base['weight_mb']:.0%} | {speeds} | "
              f"{row['agreement']:.3f} | {row['perplexity']:.2f} |")


if __name__ == "__main__":
    main()
