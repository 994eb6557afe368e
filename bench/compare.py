"""Scenarios ``quick``, ``vllm``, ``defaults`` and ``full``: tokenmill and its peers, side by side, on the same
model and load.

Each system in the scenario is started on a free loopback port, warmed up, driven at each
concurrency level by the load generator, then stopped, one system at a time. The model's
own batched decode (``bench.limit``) gives the limit. The run goes to ``bench/results/``
(JSON and PNG) and to its section of ``bench/RESULTS.md``. ``--from-json`` writes a saved
run's section and chart again; ``--setup-peers`` first installs the peers that are missing.

    python -m bench [quick|vllm|defaults|full] [--systems ...] [--concurrency ...] [--no-write]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import peers
from bench.common import Progress, default_checkpoint, load_prompts, machine, numbered, settle, versions
from bench.loadgen import LoadReport, Prompt, run_load
from bench.report import plot, render_section, write_results

BENCH_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Scenario:
    name: str
    concurrency: tuple[int, ...]
    systems: tuple[str, ...]
    time_bound_s: float
    min_requests: int = 16
    max_new_tokens: int = 64
    about: str = ""

    def requests(self, concurrency: int) -> int:
        return max(self.min_requests, 2 * concurrency)


SCENARIOS = {
    "quick": Scenario("quick", (1, 8), ("tokenmill-paged", "naive-transformers"), time_bound_s=25, min_requests=8,
                      about="about 3 minutes: tokenmill and the naive server at 1 and 8"),
    "vllm": Scenario("vllm", (1, 8, 32), ("vllm-cpu-fp32", "tokenmill-vllm"), time_bound_s=120,
                     about="vLLM's own server and tokenmill --backend vllm (the same engine, both in float32) "
                           "at 1, 8 and 32"),
    "defaults": Scenario("defaults", (1, 8, 32, 64),
                         ("tokenmill-paged", "vllm-cpu", "tokenmill-paged-fp32", "vllm-cpu-fp32"), time_bound_s=120,
                         about="tokenmill and vLLM CPU each with its default dtype (bf16 on a CPU with native bf16), "
                               "then both in float32, at 1, 8, 32 and 64"),
    "full": Scenario("full", (1, 8, 32, 64), tuple(peers.SYSTEMS), time_bound_s=120,
                     about="every system at 1, 8, 32 and 64 (about an hour with all peers installed)"),
}


def bench_system(system: peers.System, scenario: Scenario, checkpoint: peers.Checkpoint, peers_dir: Path,
                 loads: list[list[Prompt]], out_dir: Path, progress: Progress) -> dict[str, Any]:
    """Start ``system``, warm it up, drive it with ``loads`` (one list of requests per concurrency
    level, the warm-up request first), stop it."""
    entry: dict[str, Any] = {"api": system.api, "numeric_format": system.numeric_format, "note": system.note,
                             "levels": {}}
    missing = peers.missing_reason(system, checkpoint, peers_dir)
    if missing:
        progress.say(f"skip {system.name}: {missing}")
        return {**entry, "skipped": missing}
    progress.say(f"start {system.name}")
    started = time.monotonic()
    try:
        server = peers.RunningServer(system, checkpoint, peers_dir, out_dir / "logs" / f"{system.name}.log")
    except peers.ServerError as error:
        progress.say(f"skip {system.name}: {error}")
        return {**entry, "skipped": f"did not start: {str(error).splitlines()[0]}"}
    entry["startup_s"] = round(time.monotonic() - started, 1)
    with server:
        warm_up, *levels = loads
        warm = asyncio.run(run_load(server.url, system.api, warm_up, concurrency=1, requests=1,
                                    max_new_tokens=8, time_bound_s=300, model=system.model_name(checkpoint)))
        if warm.failed:
            progress.say(f"  warm-up request failed: {warm.errors}")
        for concurrency, requests in zip(scenario.concurrency, levels):
            count = len(requests)
            label = f"{system.name} c={concurrency}"
            report: LoadReport = asyncio.run(run_load(
                server.url, system.api, requests, concurrency=concurrency, requests=count,
                max_new_tokens=scenario.max_new_tokens, time_bound_s=scenario.time_bound_s,
                model=system.model_name(checkpoint), progress=progress.load(label, count)))
            report.peak_rss_mib = server.peak_rss_mib
            entry["levels"][str(concurrency)] = report.as_dict()
            progress.say(f"{label}: {report.tokens_per_s:.1f} tok/s, {report.completed} ok, {report.failed} failed, "
                         f"{report.unfinished} cut, p99 latency {report.latency_p99:.2f} s")
            if report.unfinished:
                settle(server.url, system, checkpoint, warm_up[0])
        entry["peak_rss_mib"] = server.peak_rss_mib
    return entry


def measure_limit(checkpoint: peers.Checkpoint, levels: tuple[int, ...], progress: Progress) -> dict[str, Any] | None:
    progress.say(f"limit: the model's own batched decode at {', '.join(map(str, levels))}")
    out = subprocess.run([sys.executable, "-m", "bench.limit", "--model", str(checkpoint.hf_dir), "--json",
                          "--batch", *map(str, levels)], capture_output=True, text=True, cwd=BENCH_DIR.parent)
    if out.returncode != 0:
        progress.say(f"limit failed: {out.stderr.strip().splitlines()[-1:]}")
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_scenario(scenario: Scenario, systems: list[str], checkpoint: peers.Checkpoint, peers_dir: Path,
                 out_dir: Path, command: str, with_limit: bool = True) -> dict[str, Any]:
    from transformers import AutoTokenizer

    progress = Progress()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint.hf_dir)
    prompts, prompt_set = load_prompts(tokenizer)
    counts = [1, *(scenario.requests(c) for c in scenario.concurrency)]
    firsts = [sum(counts[:i]) for i in range(len(counts))]
    loads = [numbered(tokenizer, prompts, first, count) for first, count in zip(firsts, counts)]
    run: dict[str, Any] = {
        "scenario": scenario.name, "date": datetime.date.today().isoformat(), "command": command,
        "model": "SmolLM2-135M-Instruct" if checkpoint.gguf else checkpoint.hf_dir.name,
        "prompt_set": prompt_set, "max_new_tokens": scenario.max_new_tokens, "time_bound_s": scenario.time_bound_s,
        "requests_rule": f"max({scenario.min_requests}, 2 × concurrency)", "concurrency": list(scenario.concurrency),
        "machine": machine(), "versions": versions(checkpoint, peers_dir, systems), "systems": {}}
    for name in systems:
        run["systems"][name] = bench_system(peers.SYSTEMS[name], scenario, checkpoint, peers_dir, loads, out_dir,
                                            progress)
    if with_limit:
        run["limit"] = measure_limit(checkpoint, scenario.concurrency, progress)
    progress.say("done")
    return run


def parser(scenarios: dict[str, str] | None = None) -> argparse.ArgumentParser:
    """``python -m bench``'s own command line: a scenario name (``scenarios``: each name and what it runs, the
    ones of other modules too, so that ``--help`` lists them all; default: this module's; quick when none) and
    this module's flags."""
    scenarios = scenarios or {s.name: s.about for s in SCENARIOS.values()}
    result = argparse.ArgumentParser(prog="python -m bench",
                                    description="``python -m bench``: tokenmill and its peers, side by side, on the "
                                                "same model and load.")
    result.add_argument("scenario", nargs="?", choices=list(scenarios), default="quick",
                       help="; ".join(f"{name}: {about}" for name, about in scenarios.items()))
    result.add_argument("--systems", nargs="+", choices=list(peers.SYSTEMS), help="instead of the scenario's")
    result.add_argument("--concurrency", type=int, nargs="+", help="instead of the scenario's levels")
    result.add_argument("--setup-peers", action="store_true",
                       help="first install the peers that are missing (vLLM, llama.cpp, transformers serve)")
    result.add_argument("--peers-dir", type=Path, default=peers.DEFAULT_PEERS_DIR)
    result.add_argument("--model", type=Path, help="an HF checkpoint directory instead of the default SmolLM2")
    result.add_argument("--no-limit", action="store_true", help="skip the raw batched-decode limit")
    result.add_argument("--out", type=Path, default=BENCH_DIR / "RESULTS.md", help="the results file to update")
    result.add_argument("--no-write", action="store_true", help="print the section instead of writing files")
    result.add_argument("--from-json", type=Path, metavar="RUN.json",
                       help="run nothing: write the section and chart of a saved run again")
    return result


def main(argv: list[str] | None = None, scenarios: dict[str, str] | None = None) -> None:
    """Run a scenario of ``SCENARIOS`` named in ``argv`` (or write a saved run's section again).
    ``scenarios``: the names ``--help`` lists, with what each runs (default: this module's)."""
    command_line = parser(scenarios)
    args, rest = command_line.parse_known_args(argv)
    if args.from_json:
        return publish(json.loads(args.from_json.read_text()), args.out)
    if rest:
        command_line.error(f"unrecognized arguments: {' '.join(rest)}")
    scenario = SCENARIOS[args.scenario]
    if args.concurrency:
        scenario = Scenario(scenario.name, tuple(args.concurrency), scenario.systems, scenario.time_bound_s,
                            scenario.min_requests, scenario.max_new_tokens)
    systems = args.systems or list(scenario.systems)
    checkpoint = peers.Checkpoint(args.model.resolve()) if args.model else default_checkpoint()
    if args.setup_peers:
        setup_peers(systems, args.peers_dir)
    out_dir = BENCH_DIR / "out"
    run = run_scenario(scenario, systems, checkpoint, args.peers_dir, out_dir,
                       "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:]),
                       with_limit=not args.no_limit)
    if args.no_write:
        print(render_section(run))
        return None
    publish(run, args.out)
    return None


def publish(run: dict[str, Any], results_file: Path) -> None:
    """Save the run as JSON, draw its chart, and write its section of ``results_file``."""
    results_dir = results_file.parent / "results"  # beside the results file, which links the chart
    results_dir.mkdir(parents=True, exist_ok=True)
    name = run["scenario"]
    run.pop("chart", None)
    if plot(run, results_dir / f"{name}.png"):
        run["chart"] = f"results/{name}.png"
    (results_dir / f"{name}.json").write_text(json.dumps(run, indent=1) + "\n")
    write_results(results_file, run)
    print(f"wrote {results_file} and {results_dir / name}.json/.png", file=sys.stderr)


def setup_peers(systems: list[str], peers_dir: Path) -> None:
    progress = Progress()
    for venv in dict.fromkeys(peers.SYSTEMS[s].venv for s in systems if peers.SYSTEMS[s].venv):
        assert venv is not None
        if peers.venv_python(peers_dir, venv).exists():
            continue
        log_path = BENCH_DIR / "out" / "logs" / f"setup-{venv}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        progress.say(f"installing {venv} into {peers_dir / venv} (log: {log_path})")
        with open(log_path, "wb") as log:
            try:
                peers.setup_peer(venv, peers_dir, log)
            except (subprocess.CalledProcessError, OSError) as error:
                progress.say(f"could not install {venv}: {error}; see {log_path}")


if __name__ == "__main__":
    main()
