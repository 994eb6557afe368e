"""Prefill and decode latency per batch size, straight on the engine (like TGI's text-generation-benchmark).

The engine is built as ``tokenmill launch`` builds it (same plugins, KV sizing and
warm-up), without HTTP. For each batch size: submit that many requests of
``--sequence-length`` random prompt tokens, time the step that prefills them all, then
time ``--decode-length`` decode steps of the whole batch. End-of-sequence is ignored, so
every sequence runs to its length.

    python -m bench latency [--backend paged] [--batch-size 1 2 4 8 16 32] [--sequence-length 10]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from bench.engine import start_ignoring_eos
from bench.loadgen import percentile

ABOUT = "prefill and decode latency per batch size, on the engine"
"""What ``python -m bench --help`` says the scenario runs."""


def timed(step: Any) -> float:
    started = time.perf_counter()
    step()
    return 1000 * (time.perf_counter() - started)


def measure(engine: Any, vocab_size: int, batch: int, sequence_length: int, decode_length: int,
            runs: int) -> dict[str, float]:
    from tokenmill.engine.sequence import GenerationRequest, SamplingParams

    prefill_ms: list[float] = []
    decode_ms: list[float] = []
    for run in range(-1, runs):  # run -1 warms this batch shape up and is not counted
        generator = torch.Generator().manual_seed(1000 * batch + run)
        finished = []
        for _ in range(batch):
            ids = torch.randint(100, vocab_size - 100, (sequence_length,), generator=generator).tolist()
            request = GenerationRequest("", ids, decode_length + 1, SamplingParams())
            engine.submit(request, lambda event, finished=finished:
                          finished.append(event) if getattr(event, "final", False) else None)
        timings = [timed(engine.run_once)]
        assert engine.batch_size == batch and not engine.scheduler.prefilling, "the prefill did not fit in one step"
        timings += [timed(engine.run_once) for _ in range(decode_length)]
        if run >= 0:
            prefill_ms.append(timings[0])
            decode_ms.extend(timings[1:])
        assert len(finished) == batch and engine.batch_size == 0, "every sequence ends after its decode length"
    prefill = statistics.mean(prefill_ms)
    decode = statistics.mean(decode_ms)
    return {"batch": batch, "prefill_ms": prefill, "prefill_tokens_per_s": batch * sequence_length / prefill * 1000,
            "decode_ms": decode, "decode_p50_ms": percentile(decode_ms, 50), "decode_p95_ms": percentile(decode_ms, 95),
            "decode_tokens_per_s": batch / decode * 1000}


def parser() -> argparse.ArgumentParser:
    """``python -m bench latency``'s command line."""
    result = argparse.ArgumentParser(prog="python -m bench latency", description=__doc__.splitlines()[0])
    result.add_argument("--model-id", default=None, help="default: SmolLM2-135M-Instruct")
    result.add_argument("--backend", default="auto")
    result.add_argument("--attention", default=None)
    result.add_argument("--dtype", default=None, help="as tokenmill launch's --dtype (default: auto)")
    result.add_argument("--batch-size", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    result.add_argument("--sequence-length", type=int, default=10)
    result.add_argument("--decode-length", type=int, default=8)
    result.add_argument("--prepack-weights", action=argparse.BooleanOptionalAction, default=True,
                        help="as tokenmill launch: oneDNN-packed linear weights on CPU (float32 only)")
    result.add_argument("--compile-model", action=argparse.BooleanOptionalAction, default=True,
                        help="as tokenmill launch: the paged backend's forward through torch.compile on CPU")
    result.add_argument("--runs", type=int, default=3)
    return result


def main(argv: list[str] | None = None) -> None:
    from tokenmill.config import Config

    args = parser().parse_args(argv)
    most = max(args.batch_size)
    config = Config(model_id=args.model_id, backend=args.backend, attention=args.attention, dtype=args.dtype,
                    prepack_weights=args.prepack_weights, compile_model=args.compile_model,
                    max_batch_prefill_tokens=most * args.sequence_length,
                    max_input_tokens=args.sequence_length,
                    max_total_tokens=args.sequence_length + args.decode_length + 1,
                    max_batch_total_tokens=most * (args.sequence_length + args.decode_length + 16))
    started = start_ignoring_eos(config)  # every sequence runs to its length
    engine = started.engine
    print(f"{started.loaded.model_id} in {started.loaded.dtype} ({started.loaded.dtype_reason}): "
          f"{started.chosen.backend.name} backend, {started.chosen.attention.name} "
          f"attention, {torch.get_num_threads()} threads; prompt {args.sequence_length} tokens, "
          f"{args.decode_length} decode steps, mean of {args.runs} runs")
    print(f"{'batch':>5} {'prefill ms':>11} {'prefill tok/s':>14} {'decode ms':>10} {'p50 ms':>8} {'p95 ms':>8} "
          f"{'decode tok/s':>13}")
    for batch in args.batch_size:
        row = measure(engine, started.vocab_size, batch, args.sequence_length, args.decode_length, args.runs)
        print(f"{batch:>5} {row['prefill_ms']:>11.1f} {row['prefill_tokens_per_s']:>14.1f} {row['decode_ms']:>10.1f} "
              f"{row['decode_p50_ms']:>8.1f} {row['decode_p95_ms']:>8.1f} {row['decode_tokens_per_s']:>13.1f}")


if __name__ == "__main__":
    main()
