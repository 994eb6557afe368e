"""Step times of the engine on the bench prompt set, without HTTP, and where a step's time goes.

Submits ``--concurrency`` requests of ``bench/prompts/v1.json`` (chat template applied,
64 new tokens, end-of-sequence ignored) to an engine built as ``tokenmill launch`` builds
it, steps it until all are done, and prints the time of the prefill steps and of the pure
decode steps. With ``--requests`` above the concurrency it is a closed loop, as the harness
runs its clients: each finished request submits the next. ``--profile decode`` (or
``prefill``) prints torch's operator table for one such step. For the paged backend it also
prints, over the decode steps, the median time of packing a step's inputs, of the model's forward
and of the rest (sampling, stop checks, detokenization, scheduling): the CPU work an overlap with
the forward could hide. Each is its own median, so they need not add up to the step's.

    python -m bench.steps [--concurrency 32] [--requests 64] [--dtype bfloat16] [--backend paged] [--profile decode]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from bench.engine import chat_ids, prompt_set, start_ignoring_eos


def run(engine: Any, prompt_ids: list[list[int]], concurrency: int, new_tokens: int,
        profile: str | None, adapters: list[Any] | None = None, requests: int | None = None) -> dict[str, Any]:
    """Step ``engine`` until ``requests`` (default ``concurrency``) requests of ``new_tokens`` each are
    done, ``concurrency`` at a time; request i runs with LoRA adapter ``adapters[i % len(adapters)]``
    when adapters are given."""
    from tokenmill.engine.sequence import GenerationRequest, SamplingParams, TokenEvent

    total = requests or concurrency
    finished: list[float] = []
    first_tokens: list[float] = []

    def submit(index: int) -> None:
        adapter = adapters[index % len(adapters)] if adapters else None
        request = GenerationRequest("", prompt_ids[index % len(prompt_ids)], new_tokens, SamplingParams(),
                                    adapter=adapter)
        submitted = time.perf_counter()

        def sink(event: Any) -> None:
            if isinstance(event, TokenEvent) and event.index == 1:  # indices count generated tokens from 1
                first_tokens.append(time.perf_counter() - submitted)
            if getattr(event, "final", None):
                finished.append(time.perf_counter() - submitted)
                if index + concurrency < total:  # this client sends its next request
                    submit(index + concurrency)

        engine.submit(request, sink)

    for index in range(min(concurrency, total)):
        submit(index)
    steps = StepTimes(engine)
    started = time.perf_counter()
    try:
        while len(finished) < total:
            in_flight = min(concurrency, total - len(finished))
            prefilling = bool(engine.queue_size or engine.scheduler.prefilling) or engine.batch_size < in_flight
            times = steps.prefill if prefilling else steps.decode
            if profile == ("prefill" if prefilling else "decode") and len(times) == 2:
                times.append(profiled(engine.run_once))
                continue
            steps.step(prefilling)
    finally:
        steps.restore()
    wall = time.perf_counter() - started
    phase_medians = {f"decode_{name}_ms_median": ms for name, ms in steps.decode_phase_medians_ms().items()}
    prefill, decode = steps.prefill, steps.decode
    return {**phase_medians, "wall_s": wall, "tokens_per_s": total * new_tokens / wall, "prefill_steps": len(prefill),
            "prefill_s": sum(prefill), "decode_steps": len(decode),
            "decode_ms_median": 1000 * statistics.median(decode) if decode else float("nan"),
            "ttft_p50_s": statistics.median(first_tokens),
            "latency_p99_s": sorted(finished)[min(len(finished) - 1, int(0.99 * len(finished)))]}


class PhaseTimes:
    """Seconds the paged runner spends packing a step's inputs (``_pack``), in the model's forward
    (``_forward``) and, with prefix caching, the KV-cache manager naming the blocks sequences fill
    (``_name_filled``), summed until :meth:`take`; nothing for a runner without the first two methods."""

    def __init__(self, engine: Any) -> None:
        runner, kv = engine.runner, engine.scheduler.kv
        self.spent: dict[str, float] = {}
        self.replaced: list[tuple[Any, str, Any]] = []
        """Each wrapped method's owner, name, and what the name held on the owner itself before (None:
        nothing, the class's method)."""
        if not all(hasattr(runner, method) for method in ("_pack", "_forward")):
            return
        phases = [("pack", runner, "_pack"), ("forward", runner, "_forward")]
        if getattr(kv, "prefix_caching", False) and hasattr(kv, "_name_filled"):
            phases.append(("prefix", kv, "_name_filled"))
        for name, owner, method in phases:
            self.spent[name] = 0.0
            self.replaced.append((owner, method, owner.__dict__.get(method)))
            setattr(owner, method, self._timed(name, getattr(owner, method)))

    def _timed(self, name: str, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.spent[name] += time.perf_counter() - started
        return timed

    def restore(self) -> None:
        for owner, method, before in self.replaced:
            if before is None:
                del owner.__dict__[method]  # the class's own method again
            else:
                setattr(owner, method, before)

    def take(self) -> dict[str, float]:
        spent, self.spent = self.spent, dict.fromkeys(self.spent, 0.0)
        return spent


class StepTimes:
    """The time of each engine step, prefill steps and decode steps apart, and of each decode step's
    phases (:class:`PhaseTimes`, the rest being sampling, stop checks, detokenization, scheduling)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.phases = PhaseTimes(engine)
        self.prefill: list[float] = []
        self.decode: list[float] = []
        self.decode_phases: list[dict[str, float]] = []

    def step(self, prefilling: bool) -> None:
        """Run one engine step (``engine.run_once``), counted as a prefill step or a decode step."""
        self.phases.take()
        started = time.perf_counter()
        self.engine.run_once()
        elapsed = time.perf_counter() - started
        (self.prefill if prefilling else self.decode).append(elapsed)
        if not prefilling and self.phases.spent:
            spent = self.phases.take()
            self.decode_phases.append({**spent, "rest": elapsed - sum(spent.values())})

    def decode_phase_medians_ms(self) -> dict[str, float]:
        if not self.decode_phases:
            return {}
        return {name: 1000 * statistics.median(p[name] for p in self.decode_phases) for name in self.decode_phases[0]}

    def restore(self) -> None:
        self.phases.restore()


def profiled(step: Any) -> float:
    from torch.profiler import ProfilerActivity, profile

    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        step()
    elapsed = time.perf_counter() - started
    print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    return elapsed


def parser() -> argparse.ArgumentParser:
    """``python -m bench.steps``'s command line."""
    result = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    result.add_argument("--concurrency", type=int, default=32)
    result.add_argument("--requests", type=int, default=None, help="requests in all (default: --concurrency)")
    result.add_argument("--max-batch-prefill-tokens", type=int, default=None, help="as tokenmill launch")
    result.add_argument("--waiting-served-ratio", type=float, default=None, help="as tokenmill launch")
    result.add_argument("--new-tokens", type=int, default=64)
    result.add_argument("--dtype", default=None)
    result.add_argument("--backend", default="paged")
    result.add_argument("--model-id", default=None)
    result.add_argument("--prepack-weights", action=argparse.BooleanOptionalAction, default=True,
                        help="as tokenmill launch: oneDNN-packed linear weights on CPU in float32")
    result.add_argument("--compile-model", action=argparse.BooleanOptionalAction, default=True,
                        help="as tokenmill launch: the paged backend's forward through torch.compile on CPU")
    result.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="as tokenmill launch: reuse computed prompt prefixes (paged backends)")
    result.add_argument("--profile", choices=["prefill", "decode"], help="print the operator table of one such step")
    return result


def main() -> None:
    from tokenmill.config import Config

    args = parser().parse_args()
    config = Config(model_id=args.model_id, backend=args.backend, dtype=args.dtype,
                    prepack_weights=args.prepack_weights, compile_model=args.compile_model,
                    prefix_caching=args.prefix_caching,
                    max_batch_prefill_tokens=args.max_batch_prefill_tokens,
                    waiting_served_ratio=args.waiting_served_ratio)
    started = start_ignoring_eos(config)
    config = started.config  # its limits settled for the model
    tokenizer = started.loaded.tokenizer
    prompt_ids = [chat_ids(tokenizer, p["messages"]) for p in prompt_set()["prompts"]]
    result = run(started.engine, prompt_ids, args.concurrency, args.new_tokens, args.profile,
                 requests=args.requests)
    print(f"{args.backend}, {started.loaded.dtype}, {args.requests or args.concurrency} requests, "
          f"{args.concurrency} at a time (prefill budget {config.max_batch_prefill_tokens}, "
          f"waiting-served ratio {config.waiting_served_ratio}): "
          f"{result['tokens_per_s']:.1f} tokens/s over {result['wall_s']:.1f} s; first token p50 "
          f"{result['ttft_p50_s']:.2f} s; latency p99 {result['latency_p99_s']:.1f} s; {result['prefill_steps']} steps "
          f"with prefill took {result['prefill_s']:.1f} s; {result['decode_steps']} decode steps, median "
          f"{result['decode_ms_median']:.0f} ms")
    if "decode_forward_ms_median" in result:
        prefix = result.get("decode_prefix_ms_median")
        print(f"decode steps, medians: packing the inputs {result['decode_pack_ms_median']:.1f} ms, the model's "
              f"forward {result['decode_forward_ms_median']:.1f} ms, "
              + (f"naming full blocks for the prefix cache {prefix:.2f} ms, " if prefix is not None else "")
              + "the rest (sampling, stop checks, detokenization, scheduling) "
              + f"{result['decode_rest_ms_median']:.1f} ms")


if __name__ == "__main__":
    main()
