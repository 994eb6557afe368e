"""The ``multiturn`` load on the engine alone, without HTTP: where its steps' time goes.

The same conversations as ``python -m bench multiturn`` (a shared system prompt, the history
resent each turn, greedy answers of at most ``--max-tokens``), on an engine built as
``tokenmill launch`` builds it. A conversation's next turn is submitted the moment its answer
ends, so the run is the load's critical path with nothing lost between turns. Prints the wall
time, the steps that prefilled new turns and the pure decode steps (count, seconds, median),
the decode steps' phases (as ``bench.steps`` splits them) and the prefix cache's hits.

    python -m bench.multiturn_steps [--conversations 16] [--turns 4] [--no-prefix-caching] [--block-size 16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from bench.multiturn import question, system_prompt
from bench.steps import StepTimes


def converse(engine: Any, tokenizer: Any, system: str, conversations: int, turns: int, max_tokens: int
             ) -> dict[str, Any]:
    """Step ``engine`` until every conversation has had its turns; step times by kind."""
    from tokenmill.engine.sequence import GenerationRequest, SamplingParams, TokenEvent

    histories = [[{"role": "system", "content": system}] for _ in range(conversations)]
    asked = [0] * conversations
    ready: list[int] = list(range(conversations))
    finished: set[int] = set()

    def ask(number: int) -> None:
        asked[number] += 1
        histories[number].append({"role": "user", "content": question(number, asked[number])})
        ids = tokenizer.apply_chat_template(histories[number], add_generation_prompt=True, tokenize=True,
                                            return_dict=False)

        def sink(event: Any) -> None:
            if isinstance(event, TokenEvent) and event.final is not None:
                histories[number].append({"role": "assistant", "content": event.final.generated_text})
                if asked[number] < turns:
                    ready.append(number)
                else:
                    finished.add(number)

        engine.submit(GenerationRequest("", ids, max_tokens, SamplingParams()), sink)

    steps = StepTimes(engine)
    started = time.perf_counter()
    try:
        while len(finished) < conversations:
            while ready:
                ask(ready.pop())
            steps.step(prefilling=bool(engine.queue_size or engine.scheduler.prefilling))
    finally:
        steps.restore()
    return {"wall_s": time.perf_counter() - started, "prefill": steps.prefill, "decode": steps.decode,
            "decode_phases_ms": steps.decode_phase_medians_ms()}


def parser() -> argparse.ArgumentParser:
    """``python -m bench.multiturn_steps``'s command line."""
    result = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    result.add_argument("--conversations", type=int, default=16)
    result.add_argument("--turns", type=int, default=4)
    result.add_argument("--max-tokens", type=int, default=48)
    result.add_argument("--system-tokens", type=int, default=600)
    result.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    result.add_argument("--block-size", type=int, default=None)
    return result


def main() -> None:
    from tokenmill.config import Config
    from tokenmill.engine.startup import start_engine
    from tokenmill.model.loading import Stages
    from tokenmill.plugin_manager import build_plugin_manager

    args = parser().parse_args()
    started = start_engine(Config(prefix_caching=args.prefix_caching, block_size=args.block_size,
                                  compile_before_ready=True),
                           build_plugin_manager(), Stages())
    engine, tokenizer = started.engine, started.loaded.tokenizer
    result = converse(engine, tokenizer, system_prompt(tokenizer, args.system_tokens), args.conversations,
                      args.turns, args.max_tokens)
    prefill, decode = result["prefill"], result["decode"]
    print(f"{result['wall_s']:.2f} s: {len(prefill)} steps that prefill took {sum(prefill):.2f} s; {len(decode)} "
          f"decode steps took {sum(decode):.2f} s, median {1000 * statistics.median(decode):.1f} ms; prefix cache: "
          f"{engine.scheduler.prefix_hit_tokens} of {engine.scheduler.prefix_queried_tokens} prompt tokens found")
    if result["decode_phases_ms"]:
        print("decode steps, medians (ms): " + ", ".join(f"{name} {ms:.2f}"
                                                        for name, ms in result["decode_phases_ms"].items()))


if __name__ == "__main__":
    main()
