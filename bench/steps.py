"""Step times of the engine on the bench prompt set, without HTTP, and where a step's time goes.

Submits ``--concurrency`` requests of ``bench/prompts/v1.json`` (chat template applied,
64 new tokens, end-of-sequence ignored) to an engine built as ``tokenmill launch`` builds
it, steps it until all are done, and prints the time of the prefill steps and of the pure
decode steps. ``--profile decode`` (or ``prefill``) prints torch's operator table for one
such step.

    python -m bench.steps [--concurrency 32] [--dtype bfloat16] [--backend paged] [--profile decode]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from bench.engine import chat_ids, prompt_set, start_ignoring_eos


def run(engine: Any, prompt_ids: list[list[int]], concurrency: int, new_tokens: int,
        profile: str | None, adapters: list[Any] | None = None) -> dict[str, Any]:
    """Step ``engine`` until ``concurrency`` requests of ``new_tokens`` each are done; request i runs
    with LoRA adapter ``adapters[i % len(adapters)]`` when adapters are given."""
    from tokenmill.sequence import GenerationRequest, SamplingParams

    finished: list[Any] = []
    for index in range(concurrency):
        adapter = adapters[index % len(adapters)] if adapters else None
        request = GenerationRequest("", prompt_ids[index % len(prompt_ids)], new_tokens, SamplingParams(),
                                    adapter=adapter)
        engine.submit(request, lambda event: finished.append(event) if getattr(event, "final", None) else None)
    prefill: list[float] = []
    decode: list[float] = []
    started = time.perf_counter()
    while len(finished) < concurrency:
        prefilling = bool(engine.queue_size or engine.prefilling) or engine.batch_size < concurrency - len(finished)
        times = prefill if prefilling else decode
        if profile == ("prefill" if prefilling else "decode") and len(times) == 2:
            times.append(profiled(engine.run_once))
            continue
        step_started = time.perf_counter()
        engine.run_once()
        times.append(time.perf_counter() - step_started)
    wall = time.perf_counter() - started
    return {"wall_s": wall, "tokens_per_s": concurrency * new_tokens / wall, "prefill_steps": len(prefill),
            "prefill_s": sum(prefill), "decode_steps": len(decode),
            "decode_ms_median": 1000 * statistics.median(decode) if decode else float("nan")}


def profiled(step: Any) -> float:
    from torch.profiler import ProfilerActivity, profile

    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        step()
    elapsed = time.perf_counter() - started
    print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    return elapsed


def main() -> None:
    from tokenmill.config import Config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--backend", default="paged")
    parser.add_argument("--model-id", default=None)
    parser.add_argument("--prepack-weights", action=argparse.BooleanOptionalAction, default=True,
                        help="as tokenmill launch: oneDNN-packed linear weights on CPU in float32")
    parser.add_argument("--compile-model", action=argparse.BooleanOptionalAction, default=True,
                        help="as tokenmill launch: the paged backend's forward through torch.compile on CPU")
    parser.add_argument("--profile", choices=["prefill", "decode"], help="print the operator table of one such step")
    args = parser.parse_args()
    started = start_ignoring_eos(Config(model_id=args.model_id, backend=args.backend, dtype=args.dtype,
                                        prepack_weights=args.prepack_weights, compile_model=args.compile_model))
    tokenizer = started.loaded.tokenizer
    prompt_ids = [chat_ids(tokenizer, p["messages"]) for p in prompt_set()["prompts"]]
    result = run(started.engine, prompt_ids, args.concurrency, args.new_tokens, args.profile)
    print(f"{args.backend}, {started.loaded.dtype}, {args.concurrency} requests: {result['tokens_per_s']:.1f} tokens/s "
          f"over {result['wall_s']:.1f} s; {result['prefill_steps']} steps with prefill took {result['prefill_s']:.1f} s; "
          f"{result['decode_steps']} decode steps, median {result['decode_ms_median']:.0f} ms")


if __name__ == "__main__":
    main()
