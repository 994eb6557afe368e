"""``python -m bench coldstart``'s serverless part (tokenmill only): sleeping while idle, and a scale-from-zero burst.

Asleep: a start with ``--sleep-after-idle`` (the run's first, which fills its cache); once its forward is
compiled, a c=16 load touches the KV pool, then it rests; the server tree's RSS awake (after the load) and
asleep (once ``/is_sleeping``), and the TTFT of one request sent to the server awake and asleep.

Burst: a warm start with ``--hold-while-loading``; the moment the process is spawned, 32 streaming requests
are sent (each retries its connection until the server listens) and wait through the load; how many succeed,
and the seconds from spawn to the last answer beside the server's own time to ready.

Models: a start with ``--models-dir`` (the checkpoint twice, as ``a`` and ``b``) and ``--max-loaded-models 1``;
requests alternate between the two, so each one after the first unloads a model and loads the other; the TTFT
of each (its load included) and of one to the model just loaded, and the RSS after each switch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench import peers, starts
from bench.common import Progress
from bench.loadgen import Prompt, RequestResult, one_request, run_load
from bench.report import fmt

SLEEP_AFTER_IDLE_S = 3
BURST = 32
HOLD = 64
TOUCH_REQUESTS = 32
TOUCH_CONCURRENCY = 16
TOKENS = 32
SWITCHES = 10


def ttft(server: peers.RunningServer, prompt: Prompt, model: str) -> float | None:
    async def send() -> RequestResult:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            result = RequestResult(started=0.0, prompt_id=prompt.id)
            await one_request(client, server.system.api, prompt, TOKENS, model, result)
            return result

    result = asyncio.run(send())
    return None if result.ttft is None else round(result.ttft, 3)


def asleep(system: peers.System, checkpoint: peers.Checkpoint, peers_dir: Path, first: Prompt,
           requests: list[Prompt], progress: Progress) -> dict[str, Any]:
    """RSS awake and asleep, and the TTFT of a request to the server awake and asleep."""
    log = starts.LOGS / "coldstart-tokenmill-sleep.log"
    progress.say(f"start tokenmill with --sleep-after-idle {SLEEP_AFTER_IDLE_S}")
    server = starts.TimedServer(system, checkpoint, peers_dir, log)
    model = system.model_name(checkpoint)
    with server:
        starts.wait_compiled(server)
        asyncio.run(run_load(server.url, system.api, requests[:TOUCH_REQUESTS], concurrency=TOUCH_CONCURRENCY,
                             requests=TOUCH_REQUESTS, max_new_tokens=TOKENS, time_bound_s=600, model=model))
        awake = starts.tree_memory(server)
        awake_ttft = ttft(server, first, model)
        deadline = time.monotonic() + 60
        while not httpx.get(server.url + "/is_sleeping", timeout=10).json()["is_sleeping"]:
            if time.monotonic() > deadline:
                return {"skipped": "the server did not fall asleep within 60 s"}
            time.sleep(0.2)
        sleeping = starts.tree_memory(server)
        asleep_ttft = ttft(server, first, model)
    progress.say(f"  RSS awake {awake['rss_mib']} MiB, asleep {sleeping['rss_mib']} MiB; TTFT awake "
                 f"{awake_ttft} s, asleep {asleep_ttft} s")
    return {"rss_awake_mib": awake["rss_mib"], "rss_asleep_mib": sleeping["rss_mib"],
            "pss_awake_mib": awake["pss_mib"], "pss_asleep_mib": sleeping["pss_mib"],
            "ttft_awake_s": awake_ttft, "ttft_asleep_s": asleep_ttft}


class BurstServer(starts.TimedServer):
    """A start whose burst of requests is sent the moment the process is spawned, while it loads."""

    def __init__(self, *args: Any, prompts: list[Prompt], model: str, **kwargs: Any) -> None:
        self.prompts, self.model = prompts, model
        self.results: list[RequestResult] = []
        self.last_answer_s = float("nan")
        super().__init__(*args, **kwargs)

    def _wait_healthy(self, timeout_s: float) -> None:
        """The burst, while the base class polls /health (and times ready) in a thread of its own."""
        polling = threading.Thread(target=starts.TimedServer._wait_healthy, args=(self, timeout_s), daemon=True)
        polling.start()
        self.results = asyncio.run(self._burst())
        self.last_answer_s = time.monotonic() - self.spawned
        polling.join(timeout_s)
        if math.isnan(self.ready_s):
            raise peers.ServerError(f"tokenmill was not ready; see {self.log_path}")

    async def _burst(self) -> list[RequestResult]:
        async def one(prompt: Prompt) -> RequestResult:
            result = RequestResult(started=0.0, prompt_id=prompt.id)
            async with httpx.AsyncClient(base_url=self.url, timeout=600) as client:
                while time.monotonic() < self.spawned + 600 and self.process.poll() is None:
                    try:
                        await client.get("/version")  # listening yet?
                        break
                    except httpx.TransportError:
                        await asyncio.sleep(0.05)
                await one_request(client, self.system.api, prompt, TOKENS, self.model, result)
            return result

        return list(await asyncio.gather(*(one(prompt) for prompt in self.prompts)))


def burst(system: peers.System, checkpoint: peers.Checkpoint, peers_dir: Path, requests: list[Prompt],
          progress: Progress) -> dict[str, Any]:
    """32 requests sent at spawn to a server holding up to 64 while it loads."""
    log = starts.LOGS / "coldstart-tokenmill-burst.log"
    progress.say(f"start tokenmill with --hold-while-loading {HOLD}, {BURST} requests sent at spawn")
    try:
        server = BurstServer(system, checkpoint, peers_dir, log, prompts=requests[:BURST],
                             model=system.model_name(checkpoint))
    except peers.ServerError as error:
        return {"skipped": str(error)}
    with server:
        pass
    ok = sum(1 for result in server.results if result.error is None and result.tokens)
    errors = sorted({result.error for result in server.results if result.error})
    progress.say(f"  {ok}/{BURST} answered; the last {server.last_answer_s:.1f} s after spawn, ready after "
                 f"{server.ready_s:.1f} s")
    return {"requests": BURST, "ok": ok, "failed": BURST - ok, "errors": errors[:3],
            "last_answer_s": round(server.last_answer_s, 2), "ready_s": round(server.ready_s, 2)}


def models(system: peers.System, checkpoint: peers.Checkpoint, peers_dir: Path, first: Prompt,
           progress: Progress) -> dict[str, Any]:
    """Requests alternating between two models, one loaded at a time: each loads its model."""
    log = starts.LOGS / "coldstart-tokenmill-models.log"
    progress.say(f"start tokenmill with --models-dir (two models) --max-loaded-models 1, {SWITCHES} switches")
    server = starts.TimedServer(system, checkpoint, peers_dir, log)
    switches, rss = [], []
    with server:
        for index in range(SWITCHES):
            switches.append(ttft(server, first, "ab"[index % 2]))
            rss.append(starts.tree_memory(server)["rss_mib"])
        loaded = ttft(server, first, "ab"[(SWITCHES - 1) % 2])
    progress.say(f"  TTFT with a load {switches}; loaded {loaded} s; RSS {rss} MiB")
    return {"switch_ttft_s": switches, "loaded_ttft_s": loaded, "rss_mib": rss}


def models_dir(checkpoint: peers.Checkpoint, cache_dir: Path) -> Path:
    """A models directory holding the checkpoint twice (as ``a`` and ``b``, links to it)."""
    directory = cache_dir / "models"
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("a", "b"):
        if not (directory / name).exists():
            (directory / name).symlink_to(checkpoint.hf_dir.resolve())
    return directory


def render_section(run: dict[str, Any]) -> str:
    """The ``coldstart-serverless`` section of RESULTS.md."""
    sleep, wave, several = run.get("asleep") or {}, run.get("burst") or {}, run.get("models") or {}
    out = ["<!-- bench:coldstart-serverless:begin -->", f"## Scenario `coldstart`, serverless part ({run['date']})", "",
           (f"`{run['command']}` — {run['model']}; tokenmill only (gunicorn, defaults but the flag named), each "
           "start a new process on the run's own cache dir, which the first start fills. Asleep: once the forward "
           f"is compiled, a c={TOUCH_CONCURRENCY} load touches the KV pool; RSS and PSS summed over the server's "
           "processes after it and once `/is_sleeping` says so; one request's TTFT just before sleeping and to "
           f"the sleeping server. Burst: {BURST} streaming requests sent the moment the process is spawned (each "
            "retries its connection until the server listens), answered after the load."), "",
           f"Machine: {run['machine']}.", ""]
    if sleep.get("skipped"):
        out.append(f"- Asleep: not measured ({sleep['skipped']}).")
    elif sleep:
        out.append(f"- `--sleep-after-idle {SLEEP_AFTER_IDLE_S}`, after a c={TOUCH_CONCURRENCY} load of "
                   f"{TOUCH_REQUESTS} requests: RSS awake {fmt(sleep['rss_awake_mib'], 0)} MiB, asleep "
                   f"{fmt(sleep['rss_asleep_mib'], 0)} MiB (PSS {fmt(sleep['pss_awake_mib'], 0)} → "
                   f"{fmt(sleep['pss_asleep_mib'], 0)} MiB); TTFT of one request ({TOKENS} tokens) awake "
                   f"{fmt(sleep['ttft_awake_s'], 3)} s, asleep {fmt(sleep['ttft_asleep_s'], 3)} s.")
    if wave.get("skipped"):
        out.append(f"- Burst: not measured ({wave['skipped']}).")
    elif wave:
        failures = f" ({'; '.join(wave['errors'])})" if wave["errors"] else ""
        out.append(f"- `--hold-while-loading {HOLD}`, {wave['requests']} streaming requests sent at spawn: "
                   f"{wave['ok']} answered, {wave['failed']} failed{failures}; ready {fmt(wave['ready_s'], 2)} s "
                   f"after spawn, the last answer {fmt(wave['last_answer_s'], 2)} s after spawn.")
    if several.get("switch_ttft_s"):
        out.append(f"- `--models-dir` (the checkpoint twice) `--max-loaded-models 1`, requests alternating between the "
                   f"two: TTFT with the unload and load {', '.join(fmt(v, 2) for v in several['switch_ttft_s'])} s; "
                   f"to the model just loaded {fmt(several['loaded_ttft_s'], 3)} s; RSS after each switch "
                   f"{', '.join(fmt(v, 0) for v in several['rss_mib'])} MiB.")
    out.append("<!-- bench:coldstart-serverless:end -->")
    return "\n".join(out) + "\n"


def run(cache_dir: Path, checkpoint: peers.Checkpoint, peers_dir: Path, first: Prompt, requests: list[Prompt],
        progress: Progress) -> dict[str, Any]:
    """Both measurements, each on a start of its own over ``cache_dir``."""
    sleepy = starts.tokenmill_system(cache_dir, extra=("--sleep-after-idle", str(SLEEP_AFTER_IDLE_S)))
    holding = starts.tokenmill_system(cache_dir, extra=("--hold-while-loading", str(HOLD)))
    several = dataclasses.replace(starts.tokenmill_system(cache_dir, extra=(
        "--models-dir", str(models_dir(checkpoint, cache_dir)), "--max-loaded-models", "1")), api="chat")
    return {"asleep": asleep(sleepy, checkpoint, peers_dir, first, requests, progress),
            "burst": burst(holding, checkpoint, peers_dir, requests, progress),
            "models": models(several, checkpoint, peers_dir, first, progress)}
