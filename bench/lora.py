"""LoRA on SmolLM2: a batch whose requests use 4 different adapters against the same batch on the base model.

Makes 4 random PEFT adapters (rank ``--rank`` on every attention and MLP projection) with
``peft``, starts the engine as ``tokenmill launch --lora-adapters ...`` builds it (end of
sequence ignored), and runs ``--concurrency`` requests of the prompt set, ``--new-tokens``
each: once all on the base model, once with request i on adapter i mod 4. Prints output
tokens/s and the median decode step of both, and their ratio.

    python -m bench lora [--concurrency 32] [--new-tokens 32] [--rank 16] [--backend paged]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.engine import chat_ids, prompt_set, start_ignoring_eos
from bench.steps import run

ABOUT = "a batch mixing 4 LoRA adapters against the base model, on the engine"
"""What ``python -m bench --help`` says the scenario runs."""
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_random_adapter(target: Path, seed: int, rank: int = 8, base_dir: Path | None = None,
                         config: Any = None, targets: list[str] = TARGETS) -> Path:
    """A PEFT LoRA adapter with random, non-zero A and B on ``targets`` (every projection), for the
    model in ``base_dir`` (or a random model of ``config``, whose weights do not matter to the adapter)."""
    import peft
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_config(config) if config is not None else \
        AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                                      init_lora_weights=False))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.normal_(0.0, 0.2 if rank <= 8 else 0.05)
    model.save_pretrained(target)
    return target


def parser() -> argparse.ArgumentParser:
    """``python -m bench lora``'s command line."""
    result = argparse.ArgumentParser(prog="python -m bench lora", description=__doc__.splitlines()[0])
    result.add_argument("--concurrency", type=int, default=32)
    result.add_argument("--new-tokens", type=int, default=32)
    result.add_argument("--rank", type=int, default=16)
    result.add_argument("--backend", default="paged", choices=["paged", "transformers"])
    return result


def main(argv: list[str] | None = None) -> None:
    from tokenmill.config import Config
    from tokenmill.model.loading import converted_gguf, default_gguf

    args = parser().parse_args(argv)
    source = converted_gguf(default_gguf())
    with tempfile.TemporaryDirectory() as scratch:
        names = [f"adapter{i}" for i in range(4)]
        listed = ",".join(f"{name}={write_random_adapter(Path(scratch) / name, i, args.rank, source)}"
                          for i, name in enumerate(names))
        started = start_ignoring_eos(Config(model_id=str(source), backend=args.backend, lora_adapters=listed))
        assert started.adapters is not None
        adapters = [started.adapters.pin(name) for name in names]
        prompts = [chat_ids(started.loaded.tokenizer, p["messages"]) for p in prompt_set()["prompts"]]
        run(started.engine, prompts, 4, 4, None)  # warm-up
        base = run(started.engine, prompts, args.concurrency, args.new_tokens, None)
        mixed = run(started.engine, prompts, args.concurrency, args.new_tokens, None, adapters)
    print(f"SmolLM2-135M on CPU, {args.backend} backend, {args.concurrency} requests of {args.new_tokens} new "
          f"tokens, 4 adapters of rank {args.rank} on all 7 projections:\n")
    print("| batch | tokens/s | median decode step ms |")
    print("| --- | --- | --- |")
    for label, result in (("base model only", base), ("4 adapters mixed", mixed)):
        print(f"| {label} | {result['tokens_per_s']:.1f} | {result['decode_ms_median']:.1f} |")
    print(f"\nmixed / base tokens/s: {mixed['tokens_per_s'] / base['tokens_per_s']:.2f}")


if __name__ == "__main__":
    main()
