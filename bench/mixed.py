"""Scenario ``mixed``: a flood of long requests with a trickle of short ones, under each scheduler.

The flood: ``--long-concurrency`` clients, each sending a ~1,000-token document with 256
new tokens and the next one as soon as it ends, so the batch (``--max-batch-size``) is
always full and long requests queue. The trickle: a ~20-token question with 16 new
tokens every ``--short-every`` seconds, whatever happens, sent with ``X-Priority: high``
(which ``fifo`` ignores). The same load runs against
tokenmill with ``--scheduler fifo`` and with ``--scheduler priority`` (one server at a
time), and the section compares the short requests' latency and the total output
tokens/s. Every request carries its number, so no prefix is answered from a cache.

    python -m bench mixed [--duration 150] [--no-write]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench import peers
from bench.common import default_checkpoint
from bench.engine import prompt_set
from bench.loadgen import Prompt, RequestResult, one_request, percentile
from bench.report import replace_section

ABOUT = "long and short requests under the fifo and priority schedulers"
"""What ``python -m bench --help`` says the scenario runs."""
BENCH_DIR = Path(__file__).resolve().parent
SHORT_QUESTIONS = ("What is the capital of France?", "Name a primary colour.", "How many legs has a spider?",
                   "What is two plus three?", "Which planet is closest to the Sun?", "Say hello in Spanish.")


def long_prompts(tokenizer: Any, count: int) -> list[Prompt]:
    """Documents of the prompt set cut to ~1,000 tokens, each with its own number first."""
    documents = [p for p in prompt_set()["prompts"] if p["kind"] in ("document", "long")]
    prompts = []
    for number in range(count):
        base = documents[number % len(documents)]["messages"][0]["content"]
        ids = tokenizer(f"Request {number}. {base} {base}")["input_ids"][:1000]
        prompts.append(Prompt(f"long#{number}", [], tokenizer.decode(ids)))
    return prompts


def short_prompts(count: int) -> list[Prompt]:
    return [Prompt(f"short#{n}", [], f"Question {n}. {SHORT_QUESTIONS[n % len(SHORT_QUESTIONS)]} Answer:")
            for n in range(count)]


async def mixed_load(url: str, longs: list[Prompt], shorts: list[Prompt], long_concurrency: int,
                     short_every_s: float, duration_s: float) -> dict[str, Any]:
    """Run the flood and the trickle for ``duration_s``; then cut the flood and let the last short
    requests finish. Tokens/s counts every token received, long and short, over the whole run."""
    long_results: list[RequestResult] = []
    short_results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=long_concurrency + 64, max_keepalive_connections=long_concurrency + 64)
    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(600, connect=30)) as client:
        async def flood(worker: int) -> None:
            number = worker
            while time.perf_counter() - started < duration_s:
                result = RequestResult(started=time.perf_counter() - started)
                long_results.append(result)
                await one_request(client, "tgi", longs[number % len(longs)], 256, "model", result)
                number += long_concurrency

        async def trickle() -> None:
            sent = []
            for prompt in shorts:
                if time.perf_counter() - started >= duration_s:
                    break
                result = RequestResult(started=time.perf_counter() - started)
                short_results.append(result)
                sent.append(asyncio.create_task(one_request(client, "tgi", prompt, 16, "model", result,
                                                            {"X-Priority": "high"})))
                await asyncio.sleep(short_every_s)
            await asyncio.wait(sent, timeout=300) if sent else None

        flooders = [asyncio.create_task(flood(i)) for i in range(long_concurrency)]
        await trickle()
        wall = time.perf_counter() - started
        for task in flooders:
            task.cancel()
        await asyncio.gather(*flooders, return_exceptions=True)
    short_latency = [r.latency for r in short_results if r.ok and r.latency is not None]
    tokens = sum(r.tokens for r in long_results + short_results)
    return {
        "wall_s": wall, "tokens_per_s": tokens / wall,
        "long": {"sent": len(long_results), "completed": sum(r.ok for r in long_results),
                 "failed": sum(bool(r.error) for r in long_results)},
        "short": {"sent": len(short_results), "completed": len(short_latency),
                  "failed": sum(bool(r.error) for r in short_results),
                  "latency_p50": percentile(short_latency, 50), "latency_p99": percentile(short_latency, 99),
                  "ttft_p50": percentile([r.ttft for r in short_results if r.ttft is not None], 50)},
    }


def run(duration_s: float, long_concurrency: int, short_every_s: float, max_batch_size: int,
        schedulers: list[str], server_args: list[str]) -> dict[str, Any]:
    from transformers import AutoTokenizer

    checkpoint = default_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint.hf_dir)
    longs = long_prompts(tokenizer, 400)
    shorts = short_prompts(int(duration_s / short_every_s) + 1)
    results: dict[str, Any] = {}
    for scheduler in schedulers:
        system = peers.System(f"tokenmill-{scheduler}", "tgi", "fp32", peers.tokenmill_command(
            "paged", "--dtype", "float32", "--scheduler", scheduler, "--max-batch-size", str(max_batch_size),
            *server_args))
        log = BENCH_DIR / "out" / f"mixed-{scheduler}.log"
        print(f"{scheduler}: starting", flush=True)
        with peers.RunningServer(system, checkpoint, peers.DEFAULT_PEERS_DIR, log) as server:
            results[scheduler] = asyncio.run(mixed_load(server.url, longs, shorts, long_concurrency,
                                                        short_every_s, duration_s))
        short = results[scheduler]["short"]
        print(f"{scheduler}: {results[scheduler]['tokens_per_s']:.1f} tok/s; short requests p50 "
              f"{short['latency_p50']:.2f} s, p99 {short['latency_p99']:.2f} s ({short['completed']}/{short['sent']})",
              flush=True)
    return {"settings": {"duration_s": duration_s, "long_concurrency": long_concurrency,
                         "short_every_s": short_every_s, "max_batch_size": max_batch_size,
                         "server_args": " ".join(server_args)},
            "results": results}


def render(run_data: dict[str, Any], command: str) -> str:
    settings, results = run_data["settings"], run_data["results"]
    lines = ["<!-- bench:mixed:begin -->", f"## Scenario `mixed` ({time.strftime('%Y-%m-%d')})", "",
             (f"`{command}` — SmolLM2-135M-Instruct fp32, paged backend, `--max-batch-size "
              f"{settings['max_batch_size']}`. A flood of {settings['long_concurrency']} clients sending ~1,000-token "
              f"documents with 256 new tokens back to back, and a short question (~20 tokens, 16 new tokens) every "
              f"{settings['short_every_s']:g} s with `X-Priority: high` (fifo ignores it) for "
              f"{settings['duration_s']:g} s; "
              f"greedy. Extra flags: `{settings.get('server_args') or 'none'}`."), "",
             ("| scheduler | output tok/s | short p50 s | short p99 s | short TTFT p50 s | short ok/sent "
              "| long ok/sent |"),
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, result in results.items():
        short, long = result["short"], result["long"]
        lines.append(f"| {name} | {result['tokens_per_s']:.1f} | {short['latency_p50']:.2f} | "
                     f"{short['latency_p99']:.2f} "
                     f"| {short['ttft_p50']:.2f} | {short['completed']}/{short['sent']} | "
                     f"{long['completed']}/{long['sent']} |")
    if {"fifo", "priority"} <= set(results):
        fifo, priority = results["fifo"], results["priority"]
        cut = fifo["short"]["latency_p99"] / priority["short"]["latency_p99"]
        change = priority["tokens_per_s"] / fifo["tokens_per_s"] - 1
        lines += ["", (f"`priority` against `fifo`: the short requests' p99 latency is {cut:.1f}× lower; total "
                       f"output tokens/s {abs(100 * change):.1f} % {'higher' if change >= 0 else 'lower'}.")]
    lines.append("<!-- bench:mixed:end -->")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    """``python -m bench mixed``'s command line."""
    result = argparse.ArgumentParser(prog="python -m bench mixed", description=__doc__.splitlines()[0])
    result.add_argument("--duration", type=float, default=150.0, help="seconds of flood and trickle per scheduler")
    result.add_argument("--long-concurrency", type=int, default=12)
    result.add_argument("--short-every", type=float, default=3.0)
    result.add_argument("--max-batch-size", type=int, default=8)
    result.add_argument("--schedulers", nargs="+", default=["fifo", "priority"])
    result.add_argument("--server-args", default="", help="more tokenmill launch flags for every run, in one string")
    result.add_argument("--out", type=Path, default=BENCH_DIR / "RESULTS.md")
    result.add_argument("--no-write", action="store_true")
    return result


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    run_data = run(args.duration, args.long_concurrency, args.short_every, args.max_batch_size, args.schedulers,
                   args.server_args.split())
    command = "python -m bench mixed " + " ".join(argv if argv is not None else sys.argv[1:])
    section = render(run_data, command.strip())
    if args.no_write:
        print(section)
        return
    (BENCH_DIR / "results").mkdir(exist_ok=True)
    (BENCH_DIR / "results" / "mixed.json").write_text(json.dumps(run_data, indent=1))
    args.out.write_text(replace_section(args.out.read_text(), "mixed", section))
    print(f"wrote the mixed section of {args.out}")


if __name__ == "__main__":
    main()
