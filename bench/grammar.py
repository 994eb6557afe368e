"""What a grammar costs per token: a batch decoding with and without a JSON-schema constraint.

Builds the engine as ``tokenmill launch`` does (end-of-sequence ignored so every row
runs its full length) on the tiny random model of the tests, or on ``--model-id``, and
times a batch of ``--batch-size`` requests that generate ``--new-tokens`` each: all
unconstrained, all held to a JSON schema (a list of records whose strings never end
early, so every token goes through the mask), and half of each. Rounds alternate so
that the machine's drift hits every case alike; the median round is reported.

    python -m bench grammar [--batch-size 8] [--new-tokens 64] [--rounds 5] [--model-id DIR]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.engine import start_ignoring_eos

ABOUT = "the cost per token of a JSON-schema constraint, on the engine"
"""What ``python -m bench --help`` says the scenario runs."""
RECORDS = {"type": "array", "items": {
    "type": "object",
    "properties": {"name": {"type": "string"}, "city": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "city", "age"],
}}


def tiny_model(target: Path) -> Path:
    """The tests' tiny random Llama (design.md §8) with SmolLM2's tokenizer, saved to ``target``."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tokenmill.model.loading import DEFAULT_MODEL_FILE, default_gguf

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                         initializer_range=0.3, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(target)
    gguf = default_gguf()
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=DEFAULT_MODEL_FILE).save_pretrained(target)
    return target


def run_batch(engine: Any, prompt_ids: list[int], grammars: list[Any], new_tokens: int) -> float:
    """Seconds to run one request per entry of ``grammars`` (None: unconstrained) to ``new_tokens``."""
    from tokenmill.engine.sequence import ErrorEvent, Event, GenerationRequest, SamplingParams

    ended: list[Event] = []

    def on_event(event: Event) -> None:
        if isinstance(event, ErrorEvent) or event.final is not None:
            ended.append(event)

    for grammar in grammars:
        engine.submit(GenerationRequest("", prompt_ids, new_tokens, SamplingParams(), grammar=grammar), on_event)
    started = time.perf_counter()
    while len(ended) < len(grammars):
        engine.run_once()
    errors = [e for e in ended if isinstance(e, ErrorEvent)]
    if errors:
        raise RuntimeError(f"a request failed: {errors[0].message}")
    return time.perf_counter() - started


def parser() -> argparse.ArgumentParser:
    """``python -m bench grammar``'s command line."""
    result = argparse.ArgumentParser(prog="python -m bench grammar", description=__doc__.splitlines()[0])
    result.add_argument("--batch-size", type=int, default=8)
    result.add_argument("--new-tokens", type=int, default=64)
    result.add_argument("--rounds", type=int, default=5)
    result.add_argument("--model-id", help="a checkpoint directory (default: the tests' tiny random model)")
    return result


def main(argv: list[str] | None = None) -> None:
    from tokenmill.config import Config

    args = parser().parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        model_id = args.model_id or str(tiny_model(Path(scratch) / "tiny"))
        started = start_ignoring_eos(Config(model_id=model_id, backend="paged"))
        engine, tokenizer = started.engine, started.loaded.tokenizer
        from tokenmill.http.tgi.validation import Validator

        grammar = Validator(tokenizer, Config(), started.vocab_size).grammars.json_schema(RECORDS)
        prompt_ids = tokenizer("Here are the records as JSON:")["input_ids"]
        half = args.batch_size // 2
        cases = {"unconstrained": [None] * args.batch_size, "all constrained": [grammar] * args.batch_size,
                 "half constrained": [grammar] * half + [None] * (args.batch_size - half)}
        run_batch(engine, prompt_ids, [grammar, None], 4)  # warm the grammar's lexer and the engine
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, grammars in cases.items():
                times[name].append(run_batch(engine, prompt_ids, grammars, args.new_tokens))
    tokens = args.batch_size * args.new_tokens
    print(f"{Path(model_id).name if args.model_id else 'tiny random Llama'}, batch {args.batch_size}, "
          f"{args.new_tokens} new tokens, median of {args.rounds} rounds:")
    for name, samples in times.items():
        median = statistics.median(samples)
        # Each round's ratio to the unconstrained batch run just before it: drift cancels within a round.
        extra = statistics.median(t / base - 1 for t, base in zip(samples, times["unconstrained"]))
        print(f"  {name:<17} {1000 * median / args.new_tokens:7.2f} ms per step  {tokens / median:8.1f} tokens/s  "
              f"{100 * extra:+6.1f} % time against unconstrained")


if __name__ == "__main__":
    main()
