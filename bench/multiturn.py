"""Scenario ``multiturn``: chat conversations that resend a long system prompt and their history every turn.

``--conversations`` clients (default 16) hold a conversation each, all at once: the same
~600-token system prompt (a document of the prompt set, cut to ``--system-tokens``), then
``--turns`` user questions (default 4), each sent with the whole history so far, the
assistant's earlier answers included. Every answer is greedy, at most ``--max-tokens`` (48)
long, streamed from ``/v1/chat/completions``. The systems run one at a time on the same
conversations: tokenmill and vLLM's CPU server, each with its prefix cache (their default)
and without it, both computing in ``--dtype`` (float32; bfloat16 as each runs by default on a CPU with
bf16 instructions), ``--repeats`` times in turn, each run on a newly started server. Reported,
for each system's median run: wall time, output tokens/s, time to first token (p50) per
turn, and the share of prompt tokens the server found in its prefix cache (its own counters).

    python -m bench multiturn [--conversations 16] [--turns 4] [--repeats 3] [--systems ...] [--dtype bfloat16]
                              [--no-write]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench import peers
from bench.common import default_checkpoint, machine
from bench.engine import prompt_set
from bench.loadgen import percentile, sse_payloads
from bench.report import replace_section

ABOUT = ("chats resending a shared system prompt and their history, with and without prefix caches "
         "(tokenmill and vLLM)")
"""What ``python -m bench --help`` says the scenario runs."""
BENCH_DIR = Path(__file__).resolve().parent
QUESTIONS = ("What is this document mainly about?", "Summarise its second paragraph in one sentence.",
             "Which claim in it is the most surprising, and why?", "Name one question the document leaves open.",
             "Who would find it most useful?", "Give it a short title.")


def _vllm(dtype: str, *extra: str) -> Any:
    def command(checkpoint: peers.Checkpoint, port: int, peers_dir: Path) -> list[str]:
        return peers.vllm_command("--dtype", dtype, *extra)(checkpoint, port, peers_dir)
    return command


FORMATS = {"float32": "fp32", "bfloat16": "bf16"}
"""``--dtype``: what both servers compute in, and its short name in the systems' formats."""


def systems(dtype: str = "float32") -> dict[str, peers.System]:
    """The four servers of the scenario, each told to compute in ``dtype``."""
    numeric = FORMATS[dtype]
    vllm_env = peers.SYSTEMS["vllm-cpu"].env
    return {system.name: system for system in (
        peers.System("tokenmill-paged", "chat", numeric, peers.tokenmill_command("paged", "--dtype", dtype),
                     note="prefix cache on (its default)"),
        peers.System("tokenmill-paged-no-cache", "chat", numeric,
                     peers.tokenmill_command("paged", "--dtype", dtype, "--no-prefix-caching"),
                     note="--no-prefix-caching"),
        peers.System("vllm-cpu", "chat", numeric, _vllm(dtype), venv="vllm", env=vllm_env,
                     note="vllm-cpu 0.32.0, prefix cache on (its default)"),
        peers.System("vllm-cpu-no-cache", "chat", numeric, _vllm(dtype, "--no-enable-prefix-caching"), venv="vllm",
                     env=vllm_env, note="vllm-cpu 0.32.0, --no-enable-prefix-caching"),
    )}


SYSTEMS = systems()
CACHE_COUNTERS = {
    "tokenmill": ("tokenmill_prefix_cache_queries_total", "tokenmill_prefix_cache_hits_total"),
    "vllm": ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"),
}
"""Each server's own counters of prompt tokens looked up in its prefix cache and found there."""


@dataclass
class Turn:
    conversation: int
    index: int
    """1 for the first question."""
    ttft: float | None = None
    latency: float | None = None
    tokens: int = 0
    error: str | None = None


@dataclass
class Conversation:
    number: int
    messages: list[dict[str, str]]
    turns: list[Turn] = field(default_factory=list)


def system_prompt(tokenizer: Any, tokens: int) -> str:
    """The shared system prompt: an instruction, then a document of the prompt set, cut to about ``tokens``."""
    document = next(p for p in prompt_set()["prompts"] if p["kind"] == "document")["messages"][0]["content"]
    head = "You are a helpful assistant. Answer questions about this document briefly.\n\n"
    ids = tokenizer(head + document * 2)["input_ids"][:tokens]
    return tokenizer.decode(ids)


def question(conversation: int, turn: int) -> str:
    return f"(Reader {conversation}) {QUESTIONS[(conversation + turn) % len(QUESTIONS)]}"


async def ask(client: httpx.AsyncClient, model: str, conversation: Conversation, index: int, max_tokens: int) -> None:
    """One turn: the history and a new question, streamed; the answer joins the history."""
    conversation.messages.append({"role": "user", "content": question(conversation.number, index)})
    turn = Turn(conversation.number, index)
    conversation.turns.append(turn)
    body = {"model": model, "messages": conversation.messages, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    text: list[str] = []
    sent = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                turn.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for payload in sse_payloads(response):
                if payload == "[DONE]":
                    break
                event = json.loads(payload)
                if event.get("error"):
                    turn.error = str(event["error"])
                    return
                for choice in event.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        turn.ttft = turn.ttft if turn.ttft is not None else time.perf_counter() - sent
                        text.append(piece)
                usage = event.get("usage")
                if usage:
                    turn.tokens = usage["completion_tokens"]
    except httpx.HTTPError as error:
        turn.error = f"{type(error).__name__}: {error}"
        return
    turn.latency = time.perf_counter() - sent
    conversation.messages.append({"role": "assistant", "content": "".join(text)})


async def converse(url: str, model: str, system: str, conversations: int, turns: int, max_tokens: int
                   ) -> tuple[list[Conversation], float]:
    """Every conversation at once, each turn after the previous one's answer; (conversations, wall seconds)."""
    talks = [Conversation(n, [{"role": "system", "content": system}]) for n in range(conversations)]
    limits = httpx.Limits(max_connections=conversations + 4, max_keepalive_connections=conversations + 4)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(900, connect=30)) as client:
        async def talk(conversation: Conversation) -> None:
            for index in range(1, turns + 1):
                await ask(client, model, conversation, index, max_tokens)
                if conversation.turns[-1].error:
                    return

        started = time.perf_counter()
        await asyncio.gather(*(talk(c) for c in talks))
        return talks, time.perf_counter() - started


def cache_counters(url: str, kind: str) -> tuple[float, float]:
    """(prompt tokens looked up, found) from the server's /metrics; (0, 0) where it exports none."""
    from prometheus_client.parser import text_string_to_metric_families

    queries, hits = CACHE_COUNTERS[kind]
    found = {queries: 0.0, hits: 0.0}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name in found:
                found[sample.name] += sample.value
    return found[queries], found[hits]


def bench(system: peers.System, checkpoint: peers.Checkpoint, prompt: str, args: argparse.Namespace,
          repeat: int) -> dict[str, Any]:
    """One run of the load on a server of its own, with a system prompt of its own (nothing is cached
    from another run)."""
    missing = peers.missing_reason(system, checkpoint, peers.DEFAULT_PEERS_DIR)
    if missing:
        print(f"skip {system.name}: {missing}", flush=True)
        return {"skipped": missing, "note": system.note}
    kind = "vllm" if system.name.startswith("vllm") else "tokenmill"
    print(f"{system.name}: starting", flush=True)
    log = BENCH_DIR / "out" / "logs" / f"multiturn-{system.name}.log"
    with peers.RunningServer(system, checkpoint, peers.DEFAULT_PEERS_DIR, log) as server:
        model = system.model_name(checkpoint)
        warm = Conversation(-1, [{"role": "system", "content": "Warm up."}])
        asyncio.run(_one(server.url, model, warm))  # a short unrelated request: nothing of the load is cached
        queried, found = cache_counters(server.url, kind)
        talks, wall = asyncio.run(converse(server.url, model, f"(Session {repeat}) {prompt}", args.conversations,
                                           args.turns, args.max_tokens))
        queried_after, found_after = cache_counters(server.url, kind)
    return summary(system, talks, wall, queried_after - queried, found_after - found, args.turns)


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median wall time, with every run's wall time beside it."""
    if any("skipped" in run for run in runs):
        return runs[0]
    middle = sorted(runs, key=lambda run: run["wall_s"])[len(runs) // 2]
    return {**middle, "walls_s": [run["wall_s"] for run in runs]}


def summary(system: peers.System, talks: list[Conversation], wall: float, looked_up: float, found: float,
            turns_each: int) -> dict[str, Any]:
    """One run of the load: what the section's table shows."""
    turns = [turn for talk in talks for turn in talk.turns]
    errors = list(dict.fromkeys(t.error for t in turns if t.error))[:3]
    tokens = sum(t.tokens for t in turns if not t.error)
    ttft = {str(index): percentile([t.ttft for t in turns if t.index == index and t.ttft is not None], 50)
            for index in range(1, turns_each + 1)}
    result = {"note": system.note, "wall_s": wall, "tokens_per_s": tokens / wall, "output_tokens": tokens,
              "turns_ok": sum(1 for t in turns if not t.error), "turns": len(turns), "errors": errors,
              "ttft_p50_by_turn": ttft, "cache_hit_rate": found / looked_up if looked_up else 0.0,
              "latency_p50": percentile([t.latency for t in turns if t.latency is not None], 50)}
    print(f"{system.name}: {wall:.1f} s, {result['tokens_per_s']:.1f} tok/s, TTFT p50 by turn "
          f"{', '.join(f'{v:.2f}' for v in ttft.values())} s, cache hit rate {100 * result['cache_hit_rate']:.0f} %"
          f"{', errors: ' + '; '.join(errors) if errors else ''}", flush=True)
    return result


async def _one(url: str, model: str, conversation: Conversation) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600, connect=30)) as client:
        await ask(client, model, conversation, 1, 8)


def render(run: dict[str, Any], chart: str | None) -> str:
    settings, results = run["settings"], run["results"]
    turns = settings["turns"]
    lines = ["<!-- bench:multiturn:begin -->", f"## Scenario `multiturn` ({run['date']})", "",
             (f"`{run['command']}` on {run['machine']}: SmolLM2-135M-Instruct "
              f"{FORMATS[settings.get('dtype', 'float32')]}, {settings['conversations']} "
              f"conversations at once, each {turns} turns; one shared system prompt of {settings['system_tokens']} "
              f"tokens, every turn resending the whole history; greedy, at most {settings['max_tokens']} tokens "
              "per answer "
              "(an answer may end sooner, at its end-of-sequence token), "
              f"streamed from `/v1/chat/completions`. Each system ran the load {settings.get('repeats', 1)} times, "
              "each "
              "time on a newly started server with a system prompt of its own, the systems taking turns; the row is "
              "its median run, and `all runs` lists every run's wall time. The cache hit rate is each server's own "
              "count of prompt tokens found in its prefix cache over "
              "those it looked up."), "",
             "| system | wall s | all runs s | output tok/s | "
             + " | ".join(f"TTFT p50 turn {i} s" for i in range(1, turns + 1)) + " | cache hit rate | turns ok |",
             "| --- | --- | --- | --- | " + " | ".join("---" for _ in range(turns)) + " | --- | --- |"]
    for name, result in results.items():
        if "skipped" in result:
            lines.append(f"| {name} | skipped: {result['skipped']} |")
            continue
        ttft = " | ".join(f"{result['ttft_p50_by_turn'][str(i)]:.2f}" for i in range(1, turns + 1))
        walls = ", ".join(f"{wall:.1f}" for wall in result.get("walls_s", [result["wall_s"]]))
        lines.append(f"| {name} | {result['wall_s']:.1f} | {walls} | {result['tokens_per_s']:.1f} | {ttft} | "
                     f"{100 * result['cache_hit_rate']:.0f} % | {result['turns_ok']}/{result['turns']} |")
    ours, peer = results.get("tokenmill-paged", {}), results.get("vllm-cpu", {})
    if "wall_s" in ours and "wall_s" in peer:
        later = list(range(2, turns + 1))
        ttft_ratios = ", ".join(f"turn {i} {ours['ttft_p50_by_turn'][str(i)] / peer['ttft_p50_by_turn'][str(i)]:.2f}×"
                                for i in later)
        lines += ["", (f"tokenmill's wall time is **{ours['wall_s'] / peer['wall_s']:.2f}×** vLLM's with both "
                       f"prefix caches on ({peer['wall_s'] / ours['wall_s']:.2f}× faster); its TTFT p50 against "
                       f"vLLM's: {ttft_ratios}.")]
    if chart:
        lines += ["", f"![multiturn]({chart})"]
    lines.append("<!-- bench:multiturn:end -->")
    return "\n".join(lines) + "\n"


def plot(run: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    results = {name: r for name, r in run["results"].items() if "wall_s" in r}
    if not results:
        return False
    figure, (walls, ttfts) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(results)
    walls.barh(names, [results[n]["wall_s"] for n in names], color=["#1f77b4" if n.startswith("tokenmill") else
                                                                    "#ff7f0e" for n in names])
    walls.set_xlabel("wall time, s (lower is better)")
    walls.invert_yaxis()
    turns = range(1, run["settings"]["turns"] + 1)
    for name in names:
        ttfts.plot(list(turns), [results[name]["ttft_p50_by_turn"][str(i)] for i in turns], marker="o", label=name)
    ttfts.set_xlabel("turn")
    ttfts.set_ylabel("TTFT p50, s")
    ttfts.set_xticks(list(turns))
    ttfts.legend(fontsize=8)
    figure.suptitle("multi-turn chat, shared system prompt, history resent each turn")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def parser() -> argparse.ArgumentParser:
    """``python -m bench multiturn``'s command line."""
    result = argparse.ArgumentParser(prog="python -m bench multiturn", description=__doc__.splitlines()[0])
    result.add_argument("--conversations", type=int, default=16)
    result.add_argument("--turns", type=int, default=4)
    result.add_argument("--max-tokens", type=int, default=48)
    result.add_argument("--system-tokens", type=int, default=600)
    result.add_argument("--repeats", type=int, default=3,
                        help="runs per system, each on a server of its own; the table shows the median one")
    result.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS))
    result.add_argument("--dtype", choices=list(FORMATS), default="float32",
                        help="what both servers compute in (the checkpoint is float32)")
    result.add_argument("--out", type=Path, default=BENCH_DIR / "RESULTS.md")
    result.add_argument("--no-write", action="store_true")
    return result


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoTokenizer

    args = parser().parse_args(argv)
    checkpoint = default_checkpoint()
    prompt = system_prompt(AutoTokenizer.from_pretrained(checkpoint.hf_dir), args.system_tokens)
    run = {"date": time.strftime("%Y-%m-%d"), "machine": machine(),
           "command": "python -m bench multiturn " + " ".join(argv if argv is not None else sys.argv[1:]),
           "settings": {"conversations": args.conversations, "turns": args.turns, "max_tokens": args.max_tokens,
                        "system_tokens": args.system_tokens, "repeats": args.repeats, "dtype": args.dtype},
           "results": {}}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.systems}
    chosen = systems(args.dtype)
    for repeat in range(args.repeats):  # the systems in turn, so that a slow spell of the machine hits them all
        for name in args.systems:
            runs[name].append(bench(chosen[name], checkpoint, prompt, args, repeat))
    run["results"] = {name: median_run(found) for name, found in runs.items()}
    if args.no_write:
        print(render(run, None))
        return
    results_dir = args.out.parent / "results"
    results_dir.mkdir(exist_ok=True)
    (results_dir / "multiturn.json").write_text(json.dumps(run, indent=1) + "\n")
    chart = "results/multiturn.png" if plot(run, results_dir / "multiturn.png") else None
    args.out.write_text(replace_section(args.out.read_text(), "multiturn", render(run, chart)))
    print(f"wrote the multiturn section of {args.out}")


if __name__ == "__main__":
    main()
