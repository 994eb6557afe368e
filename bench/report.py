"""Turning a harness run into ``bench/RESULTS.md`` sections and a PNG chart, and reading them back.

A run is a JSON-able dict (see ``bench.compare.run_scenario``). Each scenario owns one
section of RESULTS.md between ``<!-- bench:NAME:begin -->`` and ``<!-- bench:NAME:end -->``;
writing a run replaces its own section and leaves the rest of the file alone.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

BASELINE = "tokenmill-paged"
LIMIT_ROW = "limit: HF batched decode"


def fmt(value: float | None, digits: int = 1) -> str:
    """A table cell: ``value`` to ``digits`` decimals, ``–`` for none (or NaN)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.{digits}f}"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """The lines of a markdown table (the form :func:`parse_tables` reads back)."""
    return [_row(header), _row(["---"] * len(header)), *(_row(r) for r in rows)]


def tokens_per_s(run: dict[str, Any], system: str, level: int) -> float | None:
    report = run["systems"][system].get("levels", {}).get(str(level))
    return report["tokens_per_s"] if report else None


def limit_tokens_per_s(run: dict[str, Any], level: int) -> float | None:
    for row in (run.get("limit") or {}).get("decode", []):
        if row["batch"] == level:
            return row["tokens_per_s"]
    return None


def matmul_rate(run: dict[str, Any], system: str) -> float:
    """The 2048² matmul rate (GFLOP/s) in the system's numeric format: bf16's for bf16, else fp32's."""
    bf16 = run["systems"][system]["numeric_format"] == "bf16"
    return run["limit"]["matmul_gflops_bf16" if bf16 else "matmul_gflops_fp32"]


def matmul_gflops(run: dict[str, Any], system: str, level: int) -> float | None:
    """The weight matmuls a level computed per second: its output tokens and the prompt tokens it
    prefilled, each at its own cost (a prompt position computes no logits)."""
    report = run["systems"][system].get("levels", {}).get(str(level))
    if not report or not report.get("wall_s"):
        return None
    limit = run["limit"]
    work = (report["output_tokens"] * limit["gflop_per_token"]
            + report.get("prompt_tokens", 0) * limit["gflop_per_prompt_token"])
    return work / report["wall_s"]


def render_section(run: dict[str, Any]) -> str:
    """The markdown section of one scenario run, markers included."""
    name, levels = run["scenario"], run["concurrency"]
    columns = [f"c={c}" for c in levels]
    lines = [f"<!-- bench:{name}:begin -->", f"## Scenario `{name}` ({run['date']})", "",
             (f"`{run['command']}` — {run['model']}, prompt set v{run['prompt_set']['version']} "
              f"({run['prompt_set']['count']} prompts, {run['prompt_set']['tokens']} prompt tokens in all, "
              f"short questions to ~1,000-token documents; each request's message opens with its number, so no "
              f"two are the same text), greedy, {run['max_new_tokens']} new tokens per request, "
              f"at most {run['time_bound_s']:.0f} s per level, requests per level: {run['requests_rule']}. "
              "Every system on the same loopback, one at a time."), "",
             f"Machine: {run['machine']}. Versions: {', '.join(f'{k} {v}' for k, v in run['versions'].items())}.", "",
             "### Output tokens/s", ""]
    rows = []
    for system, entry in run["systems"].items():
        if entry.get("skipped"):
            continue
        cells = [system, entry["numeric_format"], entry["api"]]
        cells += [fmt(tokens_per_s(run, system, c)) for c in levels]
        cells.append(fmt(entry.get("peak_rss_mib"), 0))
        rows.append(cells)
    if run.get("limit"):
        rows.append([LIMIT_ROW, "fp32", "–", *[fmt(limit_tokens_per_s(run, c)) for c in levels], "–"])
    lines += table(["system", "format", "API", *columns, "peak RSS MiB"], rows)
    lines += bound_lines(run.get("limit"))
    skipped = [f"`{s}` ({e['skipped']})" for s, e in run["systems"].items() if e.get("skipped")]
    if skipped:
        lines += ["", "Not in this run: " + "; ".join(skipped) + "."]
    notes = [f"`{s}`: {e['note']}" for s, e in run["systems"].items() if e.get("note") and not e.get("skipped")]
    if notes:
        lines += ["", "Notes: " + "; ".join(notes) + "."]
    lines += ratio_lines(run, levels, columns)
    lines += ["", "### Latency (seconds; ITL in milliseconds) and requests completed / failed / cut by the time bound",
              ""]
    rows = []
    for system, entry in run["systems"].items():
        for c in levels:
            r = entry.get("levels", {}).get(str(c))
            if not r:
                continue
            rows.append([system, str(c), f"{r['completed']}/{r['failed']}/{r['unfinished']}", fmt(r["tokens_per_s"]),
                         fmt(r["ttft_p50"], 2), fmt(r["ttft_p95"], 2), fmt(ms(r["itl_p50"]), 0),
                         fmt(ms(r["itl_p95"]), 0), fmt(r["latency_p50"], 2), fmt(r["latency_p95"], 2),
                         fmt(r["latency_p99"], 2)])
    lines += table(["system", "c", "ok/failed/cut", "tok/s", "TTFT p50", "TTFT p95", "ITL p50", "ITL p95",
                    "latency p50", "latency p95", "latency p99"], rows)
    failures = [f"`{s}` c={c}: {'; '.join(r['errors'])}" for s, e in run["systems"].items()
                for c, r in e.get("levels", {}).items() if r.get("errors")]
    if failures:
        lines += ["", "Errors seen: " + " · ".join(failures)]
    if run.get("chart"):
        lines += ["", f"![tokens/s and p99 latency against concurrency]({run['chart']})"]
    lines.append(f"<!-- bench:{name}:end -->")
    return "\n".join(lines) + "\n"


def bound_lines(limit: dict[str, Any] | None) -> list[str]:
    if not limit or "arithmetic_bound_tokens_per_s" not in limit:
        return []
    return ["", (f"The limit row is the model's own batched decode (`python -m bench.limit`: forward with a KV cache, "
                 f"no server) at a batch of each concurrency. The arithmetic bound: a 2048² matmul runs at "
                 f"{limit['matmul_gflops_fp32']:.0f} GFLOP/s in fp32 ({limit['matmul_gflops_bf16']:.0f} in bf16) with "
                 f"{limit['threads']} threads; at {limit['gflop_per_token']:.2f} GFLOP of matmuls per token, fp32 "
                 f"decode cannot pass **{limit['arithmetic_bound_tokens_per_s']:.0f} tokens/s** on this machine.")]


def ms(seconds: float | None) -> float | None:
    """Seconds in milliseconds; None stays None."""
    return None if seconds is None else seconds * 1000


def ratio_lines(run: dict[str, Any], levels: list[int], columns: list[str]) -> list[str]:
    if BASELINE not in run["systems"] or run["systems"][BASELINE].get("skipped"):
        return []
    ours = {c: tokens_per_s(run, BASELINE, c) for c in levels}
    rows = []
    for system, entry in run["systems"].items():
        if system == BASELINE or entry.get("skipped"):
            continue
        rows.append([system, *[ratio(ours[c], tokens_per_s(run, system, c)) for c in levels]])
    if run.get("limit"):
        rows.append([f"share of the {LIMIT_ROW}", *[_share(ours[c], limit_tokens_per_s(run, c)) for c in levels]])
        bound = run["limit"].get("arithmetic_bound_tokens_per_s")
        if bound:
            # fp32's rate, output tokens only: the same row for every run, whatever the baseline's dtype
            rows.append(["share of the arithmetic bound", *[_share(ours[c], bound) for c in levels]])
        if run["limit"].get("gflop_per_prompt_token"):
            rate = matmul_rate(run, BASELINE)
            rows.append([f"share of the {run['systems'][BASELINE]['numeric_format']} matmul bound, prompts counted",
                         *[_share(matmul_gflops(run, BASELINE, c), rate) for c in levels]])
    return ["", f"### `{BASELINE}` tokens/s divided by each system's", "", *table(["against", *columns], rows)]


def ratio(ours: float | None, theirs: float | None) -> str:
    """``ours / theirs`` as a table cell (``1.50×``), ``–`` where either is missing or zero."""
    if not ours or not theirs:
        return "–"
    return f"{ours / theirs:.2f}×"


def _share(ours: float | None, limit: float | None) -> str:
    if not ours or not limit:
        return "–"
    return f"{100 * ours / limit:.0f} %"


def replace_section(document: str, name: str, section: str) -> str:
    """``document`` with scenario ``name``'s section replaced by ``section`` (appended if absent)."""
    pattern = re.compile(rf"<!-- bench:{re.escape(name)}:begin -->.*?<!-- bench:{re.escape(name)}:end -->\n?", re.S)
    if pattern.search(document):
        return pattern.sub(lambda _: section, document, count=1)
    return document.rstrip("\n") + "\n\n" + section


def sections(document: str) -> dict[str, str]:
    """Every scenario section of ``document`` by name."""
    found = re.finditer(r"<!-- bench:([\w-]+):begin -->.*?<!-- bench:\1:end -->", document, re.S)
    return {match.group(1): match.group(0) for match in found}


def parse_tables(section: str) -> dict[str, list[dict[str, str]]]:
    """The markdown tables of a section, by the ``###`` heading above each, as lists of row dicts."""
    tables: dict[str, list[dict[str, str]]] = {}
    heading = ""
    lines = section.splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("### "):
            heading = line[4:].strip()
        elif line.startswith("|") and index + 1 < len(lines) and re.fullmatch(r"\|( --- \|)+", lines[index + 1]):
            header = _cells(line)
            rows = []
            index += 2
            while index < len(lines) and lines[index].startswith("|"):
                rows.append(dict(zip(header, _cells(lines[index]))))
                index += 1
            tables[heading] = rows
            continue
        index += 1
    return tables


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def write_results(path: Path, run: dict[str, Any]) -> None:
    document = path.read_text() if path.exists() else "# Benchmark results\n"
    path.write_text(replace_section(document, run["scenario"], render_section(run)))


def plot(run: dict[str, Any], png: Path) -> bool:
    """Tokens/s and p99 latency against concurrency, one line per system; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    levels = run["concurrency"]
    figure, (throughput, latency) = plt.subplots(1, 2, figsize=(12, 4.5))
    for system, entry in run["systems"].items():
        reports = [entry.get("levels", {}).get(str(c)) for c in levels]
        if entry.get("skipped") or not any(reports):
            continue
        xs = [c for c, r in zip(levels, reports) if r]
        style = {"marker": "o", "linewidth": 2.5 if system.startswith("tokenmill") else 1.5, "label": system}
        throughput.plot(xs, [r["tokens_per_s"] for r in reports if r], **style)
        latency.plot(xs, [r["latency_p99"] for r in reports if r], **style)
    limit = [(c, limit_tokens_per_s(run, c)) for c in levels]
    if any(v for _, v in limit):
        throughput.plot([c for c, v in limit if v], [v for _, v in limit if v], "k--", label=LIMIT_ROW)
    for axis, title, unit in ((throughput, "output tokens/s", "tokens/s"), (latency, "request latency p99", "s")):
        axis.set_xscale("log", base=2)
        axis.set_xticks(levels, [str(c) for c in levels])
        axis.set_xlabel("concurrent requests")
        axis.set_ylabel(unit)
        axis.set_title(title)
        axis.grid(alpha=0.3)
    throughput.legend(fontsize=8)
    figure.suptitle(f"scenario {run['scenario']}, {run['model']}, {run['date']}")
    figure.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png, dpi=100)
    plt.close(figure)
    return True
