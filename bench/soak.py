"""Scenario ``soak``: one tokenmill server under a bounded flood of valid, invalid and rude requests.

One server (SmolLM2-135M unless ``--model-id``; ``--backend auto``, ``--max-concurrent-requests 8``)
takes ``--requests`` requests (2000) from ``--concurrency`` clients (24) at once, over TGI's routes
(``/generate``, ``/generate_stream``, ``/``) and OpenAI's (``/v1/completions``,
``/v1/chat/completions``, streamed and not): valid requests with random parameters and 1-16 new
tokens; bad types, out-of-range values, too many stop sequences, over-long inputs, malformed
and deeply nested JSON, unknown fields; clients that hang up mid-stream or abandon a request;
slow readers; and bursts of twice ``--max-concurrent-requests`` at once (``bench.soak_requests``
makes them). A request answered 429 is sent again after a backoff, so overload comes and goes.
The first 10 % is a warm-up. Reported: the last HTTP status of each request, per kind; requests without
an answer; latency of the successful ones; the server's resident memory (its process and children:
psutil's RSS, the VmRSS of /proc) idle after the warm-up and at the end; and, idle, whether every KV
block and concurrency slot came back (``/info``'s ``kv``, the ``tokenmill_requests_in_flight`` gauge);
and how many full garbage collections, each a pause of every thread, ran after the warm-up
(``python_gc_collections_total{generation="2"}``). The goals are printed met or missed; exit status 1
when one is missed. The KV pool is kept small (``--kv-tokens``) and made resident whole before anything
is measured: its pages are first touched as its blocks are first handed out, which would otherwise read
as growth. ``--kinds`` narrows the mix, ``--server-args`` adds server flags.

    python -m bench soak [--requests 2000] [--concurrency 24] [--kinds ...] [--model-id DIR] [--no-write]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench import peers
from bench.common import Progress, default_checkpoint, machine
from bench.loadgen import percentile
from bench.report import replace_section
from bench.soak_requests import KINDS, ROUTES, Job, encode, make_job, prompt

ABOUT = ("thousands of valid, invalid and rude requests on one server; its goals (no 5xx, every request "
         "answered, RSS flat, KV back) set the exit status")
"""What ``python -m bench --help`` says the scenario runs."""
BENCH_DIR = Path(__file__).resolve().parent
RSS_GROWTH_LIMIT_MB = 50.0
RETRIES = 30
DEADLINE_S = 300


@dataclass
class Outcome:
    kind: str
    status: int | None  # None: no answer (a connection error, a timeout), or the client hung up first
    latency: float
    error: str | None = None  # why there was no answer, or a stream's error event
    body: str = ""
    cut: bool = False  # a 200 stream that ended without its last event
    gone: bool = False  # the client hung up on purpose before the end
    sent: str = ""
    retries: int = 0  # 429 answers before this one
    route: str = ""


def stream_end(payload: str) -> tuple[bool, str | None]:
    """(is this the stream's last event, its error if it is one)."""
    if payload == "[DONE]":
        return True, None
    try:
        event = json.loads(payload)
    except ValueError:
        return False, f"not JSON: {payload[:120]}"
    if isinstance(event, dict) and event.get("error"):
        return True, json.dumps(event)[:300]
    return isinstance(event, dict) and event.get("generated_text") is not None, None


async def send(client: httpx.AsyncClient, job: Job) -> Outcome:
    """Send ``job`` and read its answer as the job says (all, slowly, or hanging up early)."""
    started = time.perf_counter()
    outcome = Outcome(job.kind, None, 0.0, sent=job.content[:160].decode(errors="replace"), route=job.route)
    try:
        async with client.stream("POST", job.route, content=job.content,
                                 headers={"Content-Type": "application/json"}) as response:
            outcome.status = response.status_code
            if response.status_code != 200 or not job.stream or "text/event-stream" not in response.headers.get(
                    "content-type", ""):
                outcome.body = (await response.aread())[:400].decode(errors="replace")
            else:
                events, ended = 0, False
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    if job.cut_after is not None and events >= job.cut_after:
                        outcome.gone = True
                        break
                    events += 1
                    ended, error = stream_end(line[5:].strip())
                    outcome.error = outcome.error or error
                    if job.pause_s:
                        await asyncio.sleep(job.pause_s)
                outcome.cut = not ended and not outcome.gone
    except httpx.HTTPError as error:
        outcome.status, outcome.error = None, f"{type(error).__name__}: {error}"[:200]
    outcome.latency = time.perf_counter() - started
    return outcome


async def abandon(client: httpx.AsyncClient, job: Job) -> Outcome:
    """Send a non-streamed request and hang up after ``job.cut_after`` ms unless answered by then."""
    try:
        return await asyncio.wait_for(send(client, job), (job.cut_after or 1) / 1000)
    except asyncio.TimeoutError:  # noqa: UP041 (not TimeoutError before Python 3.11)
        return Outcome(job.kind, None, 0.0, gone=True)


async def answer(client: httpx.AsyncClient, job: Job) -> Outcome:
    """:func:`send` (:func:`abandon` for that kind) within ``DEADLINE_S``: a soak must not wait forever."""
    try:
        return await asyncio.wait_for(abandon(client, job) if job.kind == "abandon" else send(client, job), DEADLINE_S)
    except asyncio.TimeoutError:  # noqa: UP041
        return Outcome(job.kind, None, DEADLINE_S, error=f"no answer within {DEADLINE_S} s",
                       sent=job.content[:160].decode(errors="replace"), route=job.route)


async def drive(url: str, plan: list[str], concurrency: int, burst: int, seed: int,
                tick: Callable[[int], None]) -> list[Outcome]:
    """Run every kind of ``plan`` from ``concurrency`` clients; a ``burst`` sends ``burst`` requests at once.
    A request answered 429 is sent again after a backoff (50 ms doubling to 2 s), up to ``RETRIES`` times,
    except in a burst: so that overload comes and goes and every kind of request reaches the server."""
    rng = random.Random(seed)
    jobs = iter(plan)
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=concurrency + burst + 8, max_keepalive_connections=concurrency + burst)
    timeout = httpx.Timeout(120, connect=30, pool=600)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        async def worker() -> None:
            for kind in jobs:  # shared: each kind is taken by one worker
                if kind == "burst":
                    body = [encode({"inputs": prompt(rng), "parameters": {"max_new_tokens": rng.randint(1, 4)}})
                            for _ in range(burst)]
                    got = await asyncio.gather(*(answer(client, Job("burst", "/generate", b)) for b in body))
                else:
                    job = make_job(kind, rng)
                    for retry in range(RETRIES):
                        outcome = await answer(client, job)
                        if outcome.status != 429 or retry == RETRIES - 1:
                            break
                        await asyncio.sleep(rng.uniform(0.5, 1.5) * min(2.0, 0.05 * 2**retry))
                    outcome.retries = retry
                    got = [outcome]
                outcomes.extend(got)
                tick(len(got))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes


async def fill_pool(url: str, kv_tokens: int, max_input_tokens: int, seed: int) -> None:
    """Hand out every KV block once, one long prompt after another. The paged pool is allocated
    uninitialised and a block is zeroed (its pages made resident) when first handed out, the free
    list in turn: after this the whole pool is resident, and RSS growth is not the pool's first touch."""
    rng = random.Random(seed)
    tokens = min(max_input_tokens, 2048)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600, connect=30)) as client:
        for _ in range(-(-kv_tokens // tokens) + 1):
            text = " ".join(str(rng.randrange(10**6)) for _ in range(tokens))  # at least a token a number
            body = {"inputs": text, "parameters": {"max_new_tokens": 1, "truncate": tokens}}
            response = await client.post("/generate", json=body)
            response.raise_for_status()


def make_plan(requests: int, burst: int, rng: random.Random, kinds: list[str]) -> list[str]:
    """Random ``kinds`` adding up to ``requests`` requests (a burst counts as ``burst``)."""
    plan: list[str] = []
    total = 0
    while total < requests:
        kind = rng.choices(kinds, weights=[KINDS[k] for k in kinds])[0]
        if kind == "burst" and total + burst > requests:
            if kinds == ["burst"]:
                break
            continue
        plan.append(kind)
        total += burst if kind == "burst" else 1
    return plan


def idle_state(url: str, baseline_blocks: int | None = None, wait_s: float = 60) -> dict[str, Any]:
    """The server's /info and in-flight gauge once nothing runs (or after ``wait_s``)."""
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + wait_s
    while True:
        try:
            info = httpx.get(url + "/info", timeout=30).json()
            samples = [s for f in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text)
                       for s in f.samples]
        except httpx.HTTPError as error:
            return {"unreachable": str(error)}
        kv = info.get("kv") or {}
        state = {"queue_size": info["queue_size"], "batch_size": info["batch_size"], "backend": info.get("backend"),
                 "in_flight": next((s.value for s in samples if s.name == "tokenmill_requests_in_flight"), None),
                 "kv_blocks_used": kv.get("blocks_used"), "kv_blocks_total": kv.get("blocks_total"),
                 "kv_blocks_cached": kv.get("blocks_cached"), "full_gc": full_collections(samples)}
        done = not state["queue_size"] and not state["batch_size"] and not state["in_flight"] and (
            baseline_blocks is None or (state["kv_blocks_used"] or 0) <= baseline_blocks)
        if done or time.monotonic() > deadline:
            return state
        time.sleep(0.5)


def full_collections(samples: list[Any]) -> float:
    """How many full garbage collections (generation 2) the server process has run."""
    return next((s.value for s in samples if s.name == "python_gc_collections_total"
                 and s.labels.get("generation") == "2"), 0.0)


def label(outcome: Outcome) -> str:
    return "gone" if outcome.gone else "none" if outcome.status is None else str(outcome.status)


def summarise(outcomes: list[Outcome], rss: dict[str, float], before: dict[str, Any], after: dict[str, Any],
              healthy: bool, alive: bool) -> dict[str, Any]:
    """Counts, latency, memory and the goals, met or not."""
    by_kind: dict[str, Counter[str]] = {}
    for o in outcomes:
        by_kind.setdefault(o.kind, Counter())[label(o)] += 1
    unanswered = [o for o in outcomes if (o.status is None or o.cut) and not o.gone]
    failed = [o for o in outcomes if (o.status or 0) >= 500]
    stream_errors = [o for o in outcomes if o.status == 200 and o.error]
    refused = [o for o in outcomes if o.kind in ROUTES and o.status not in (None, 200, 429)]
    ok = [o.latency for o in outcomes if o.status is not None and 200 <= o.status < 300 and not o.cut
          and not o.error and o.kind not in ("slow_reader", "disconnect", "abandon")]
    growth = rss["end_mb"] - rss["warm_mb"]
    kv_back = "unreachable" not in after and before["kv_blocks_used"] == after["kv_blocks_used"] == 0 and not after[
        "in_flight"]
    goals = {"no 5xx (nor an error event in a 200 stream)": not failed and not stream_errors,
             "every request answered (no timeout, connection error or cut stream)": not unanswered,
             f"RSS growth after warm-up < {RSS_GROWTH_LIMIT_MB:.0f} MB": growth < RSS_GROWTH_LIMIT_MB,
             "idle after the run: /health 200, every KV block and concurrency slot back": healthy and alive and kv_back}
    samples = {"failures": failed, "stream_errors": stream_errors, "no_answer": unanswered, "valid_refused": refused}
    return {"requests": len(outcomes), "retried_429": sum(o.retries for o in outcomes),
            "statuses": dict(sorted(Counter(label(o) for o in outcomes).items())),
            "by_kind": {k: dict(sorted(c.items())) for k, c in sorted(by_kind.items())},
            "unanswered": len(unanswered), "latency_p50_s": percentile(ok, 50), "latency_p99_s": percentile(ok, 99),
            "successful_timed": len(ok), "rss_mb": {**rss, "growth_mb": growth}, "idle_before": before,
            "idle_after": after, "healthy": healthy, "server_alive": alive, "goals": goals,
            **{name: grouped(found)[:12] for name, found in samples.items()}}


def grouped(found: list[Outcome]) -> list[dict[str, Any]]:
    """One entry per (kind, route, status, answer): how many, and the opening of the first one's request."""
    groups: dict[tuple[str, str, int | None, str], dict[str, Any]] = {}
    for o in found:
        key = (o.kind, o.route, o.status, (o.body or o.error or "stream cut")[:240])
        groups.setdefault(key, {"kind": o.kind, "route": o.route, "status": o.status, "answer": key[3], "count": 0,
                                "sent": o.sent})
        groups[key]["count"] += 1
    return list(groups.values())


def code(text: str, width: int) -> str:
    return "`" + text[:width].replace("`", "'").replace("\n", " ") + "`"


def render(run: dict[str, Any]) -> str:
    s = run["summary"]
    statuses = sorted({status for counts in s["by_kind"].values() for status in counts})
    rss, after = s["rss_mb"], s["idle_after"]
    lines = ["<!-- bench:soak:begin -->", f"## Scenario `soak` ({run['date']})", "",
             (f"`{run['command']}` on {run['machine']}: one tokenmill server ({run['model']}, backend "
              f"`{after.get('backend')}`, `--max-concurrent-requests {run['max_concurrent_requests']}`, "
              f"`--max-batch-total-tokens {run['kv_tokens']}`, the KV pool made resident first), "
              f"{s['requests']} requests from {run['concurrency']} clients, bursts of {run['burst']}, seed "
              f"{run['seed']}, in {run['wall_s']:.0f} s. A request answered 429 was sent again, up to {RETRIES} times "
              f"(not in a burst): {s['retried_429']} such 429s; the table counts each request's last answer. "
              "`gone`: the client hung up on purpose; `none`: no answer."),
             "", "| kind | " + " | ".join(statuses) + " |", "| --- |" + " --- |" * len(statuses),
             *(f"| {kind} | " + " | ".join(str(counts.get(status, "")) for status in statuses) + " |"
               for kind, counts in s["by_kind"].items()),
             "| **all** | " + " | ".join(f"**{s['statuses'].get(status, 0)}**" for status in statuses) + " |", "",
             (f"Latency of the {s['successful_timed']} successful requests (not slow readers nor hang-ups): p50 "
              f"{s['latency_p50_s']:.2f} s, p99 {s['latency_p99_s']:.2f} s. Server RSS: {rss['start_mb']:.0f} MB idle "
              f"with the KV pool resident, {rss['warm_mb']:.0f} MB after the warm-up, {rss['end_mb']:.0f} MB at the "
              f"end: **{rss['growth_mb']:+.1f} MB**; under load at each tenth of the run: "
              f"{', '.join(map(str, rss.get('under_load_by_tenth', [])))} MB. Idle, KV blocks in use before/after: "
              f"{s['idle_before'].get('kv_blocks_used')}/{after.get('kv_blocks_used')} of "
              f"{after.get('kv_blocks_total')}; requests in flight after: {after.get('in_flight')}. Full garbage "
              f"collections after the warm-up: {s.get('full_gc_after_warm_up', 0):.0f}."), "",
             *(f"- {'met' if met else '**missed**'}: {goal}" for goal, met in s["goals"].items())]
    for name in ("failures", "stream_errors", "no_answer"):
        lines += [f"- {name.replace('_', ' ')}: {g['count']} × {g['kind']} on `{g.get('route')}` → {g['status']}: "
                  f"{code(g['answer'], 160)} (sent {code(g['sent'], 60)})" for g in s[name]]
    lines.append("<!-- bench:soak:end -->")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    """``python -m bench soak``'s command line."""
    result = argparse.ArgumentParser(prog="python -m bench soak", description=__doc__.splitlines()[0])
    result.add_argument("--requests", type=int, default=2000)
    result.add_argument("--concurrency", type=int, default=24)
    result.add_argument("--max-concurrent-requests", type=int, default=8, help="the server's")
    result.add_argument("--model-id", help="an HF checkpoint directory or id instead of SmolLM2-135M")
    result.add_argument("--backend", default="auto")
    result.add_argument("--kv-tokens", type=int, default=4096,
                        help="the server's --max-batch-total-tokens: a KV pool small enough to be made resident whole "
                             "before memory is measured")
    result.add_argument("--server-args", default="", help='more flags for the server, e.g. "--no-compile-model"')
    result.add_argument("--seed", type=int, default=0)
    result.add_argument("--kinds", nargs="+", choices=list(KINDS), default=list(KINDS),
                        help="send only these kinds of request (to narrow a failure down)")
    result.add_argument("--out", type=Path, default=BENCH_DIR / "RESULTS.md")
    result.add_argument("--no-write", action="store_true")
    return result


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds, so the server is stopped too
    progress = Progress()
    checkpoint = peers.Checkpoint(Path(args.model_id)) if args.model_id else default_checkpoint()
    burst = 2 * args.max_concurrent_requests
    plan = make_plan(args.requests, burst, random.Random(args.seed), args.kinds)
    split = next(i for i in range(len(plan) + 1) if sum(burst if k == "burst" else 1 for k in plan[:i])
                 >= args.requests // 10)
    system = peers.System("tokenmill", "tgi", "fp32", peers.tokenmill_command(
        args.backend, "--dtype", "float32", "--max-concurrent-requests", str(args.max_concurrent_requests),
        "--max-batch-total-tokens", str(args.kv_tokens), *shlex.split(args.server_args)))
    progress.say(f"start tokenmill (backend {args.backend}); {len(plan)} jobs, {args.requests} requests")
    started = time.monotonic()
    log = BENCH_DIR / "out" / "logs" / "soak.log"
    with peers.RunningServer(system, checkpoint, peers.DEFAULT_PEERS_DIR, log) as server:
        info = httpx.get(server.url + "/info", timeout=30).json()
        asyncio.run(fill_pool(server.url, args.kv_tokens, info["max_input_tokens"], args.seed))
        before = idle_state(server.url)
        rss = {"start_mb": server.rss_bytes() / 1e6}
        progress.say(f"KV pool resident: RSS {rss['start_mb']:.0f} MB; warm-up")
        samples: list[float] = []  # RSS (MB) under load at each tenth of the requests
        sent = [0]

        def tick(count: int) -> None:
            sent[0] += count
            if sent[0] * 10 // args.requests > len(samples):
                samples.append(server.rss_bytes() / 1e6)
                progress.say(f"  {sent[0]}/{args.requests} requests, RSS {samples[-1]:.0f} MB")

        outcomes = asyncio.run(drive(server.url, plan[:split], args.concurrency, burst, args.seed, tick))
        warm = idle_state(server.url, before["kv_blocks_used"])
        rss["warm_mb"] = server.rss_bytes() / 1e6
        progress.say(f"warm-up: {len(outcomes)} requests, RSS {rss['warm_mb']:.0f} MB")
        outcomes += asyncio.run(drive(server.url, plan[split:], args.concurrency, burst, args.seed + 1, tick))
        after = idle_state(server.url, before["kv_blocks_used"])
        rss["end_mb"] = server.rss_bytes() / 1e6
        rss["peak_mb"] = server.peak_rss_bytes / 1e6
        alive = server.process.poll() is None
        try:
            healthy = httpx.get(server.url + "/health", timeout=30).status_code == 200
        except httpx.HTTPError:
            healthy = False
    wall = time.monotonic() - started
    summary = summarise(outcomes, rss, before, after, healthy, alive)
    summary["rss_mb"]["under_load_by_tenth"] = [round(mb) for mb in samples]
    summary["full_gc_after_warm_up"] = after.get("full_gc", 0) - warm.get("full_gc", 0)
    run = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "wall_s": wall,
           "command": "python -m bench soak " + " ".join(argv if argv is not None else sys.argv[1:]),
           "model": args.model_id or "SmolLM2-135M-Instruct", "concurrency": args.concurrency, "burst": burst,
           "max_concurrent_requests": args.max_concurrent_requests, "kv_tokens": args.kv_tokens, "seed": args.seed,
           "server_args": args.server_args, "summary": summary}
    section = render(run)
    print(section)
    for name in ("failures", "stream_errors", "no_answer", "valid_refused"):
        for item in summary[name]:
            print(f"{name}: {json.dumps(item)}")
    if not args.no_write:
        results_dir = args.out.parent / "results"
        results_dir.mkdir(exist_ok=True)
        (results_dir / "soak.json").write_text(json.dumps(run, indent=1) + "\n")
        args.out.write_text(replace_section(args.out.read_text(), "soak", section))
        progress.say(f"wrote the soak section of {args.out}")
    if not all(summary["goals"].values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
