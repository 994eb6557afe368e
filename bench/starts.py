"""What ``coldstart`` and its serverless part share: a tokenmill start timed to its first ``/health`` 200,
the memory of a server's process tree, and the wait for its compiled forward."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench import peers
from bench.common import server_info

BENCH_DIR = Path(__file__).resolve().parent
LOGS = BENCH_DIR / "out" / "logs"
MIB = 2**20
POLL_S = 0.05
COMPILE_STAGE = "compiling the forward"
"""tokenmill's background compile: a load stage that runs after ready, so it has no share of it."""
OTHER_STAGE = "other (process start, imports, the HTTP server)"


def stage_shares(stages: list[dict[str, Any]], ready_s: float) -> list[dict[str, Any]]:
    """Each load stage with its share of the time to ready, and what the stages leave of it; the
    background compile runs after ready and has no share."""
    rows = [{"stage": s["stage"], "seconds": s["seconds"], "detail": s.get("detail", ""),
             "share": None if s["stage"] == COMPILE_STAGE or not ready_s else s["seconds"] / ready_s} for s in stages]
    rest = ready_s - sum(r["seconds"] for r in rows if r["share"] is not None)
    return [*rows, {"stage": OTHER_STAGE, "seconds": round(rest, 3), "detail": "", "share": rest / ready_s}]


class TimedServer(peers.RunningServer):
    """A RunningServer that polls its health every ``POLL_S`` and notes when it first answered 200."""

    def __init__(self, system: peers.System, checkpoint: peers.Checkpoint, peers_dir: Path, log: Path) -> None:
        self.spawned = time.monotonic()
        self.ready_s = float("nan")
        super().__init__(system, checkpoint, peers_dir, log)

    def _wait_healthy(self, timeout_s: float) -> None:
        with httpx.Client(timeout=5) as client:
            while time.monotonic() < self.spawned + timeout_s:
                if self.process.poll() is not None:
                    raise peers.ServerError(f"{self.system.name} exited with {self.process.returncode} while "
                                            f"starting; last lines of {self.log_path}:\n{peers.tail(self.log_path)}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(self.url + self.system.health_path).status_code == 200:
                        self.ready_s = time.monotonic() - self.spawned
                        return
                time.sleep(POLL_S)
        raise peers.ServerError(f"{self.system.name} was not healthy after {timeout_s:.0f} s; see {self.log_path}")


def tree_memory(server: peers.RunningServer) -> dict[str, float | None]:
    """RSS and PSS (MiB) summed over the server's process and every process under it."""
    try:
        root = psutil.Process(server.process.pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return {"rss_mib": None, "pss_mib": None}
    rss = pss = 0
    for process in processes:
        with contextlib.suppress(psutil.Error):
            info = process.memory_full_info()
            rss, pss = rss + info.rss, pss + info.pss
    return {"rss_mib": round(rss / MIB, 1), "pss_mib": round(pss / MIB, 1), "processes": len(processes)}


class CompiledWatch:
    """Polls tokenmill's /info, in a thread of its own, until ``forward`` is no longer ``compiling``: the time
    to the compiled forward is then seen even while requests run."""

    def __init__(self, server: TimedServer, timeout_s: float = 900) -> None:
        self.server = server
        self.timeout_s = timeout_s
        self.found: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._poll, name="compiled-watch", daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        server = self.server
        info = server_info(server.url)
        while info.get("forward") == "compiling" and time.monotonic() < server.spawned + self.timeout_s:
            time.sleep(0.25)
            info = server_info(server.url)
        compiled = info.get("forward") == "compiled"
        self.found = {"forward": info.get("forward"), "forward_from_cache": info.get("forward_from_cache"),
                      "compiled_s": round(time.monotonic() - server.spawned, 2) if compiled else None,
                      "stages": stage_shares(info.get("load_stages") or [], server.ready_s)}

    def result(self) -> dict[str, Any]:
        """``forward``, ``forward_from_cache``, ``compiled_s`` (after launch) and the load stages, once known."""
        self.thread.join()
        return self.found


def wait_compiled(server: TimedServer, timeout_s: float = 900) -> dict[str, Any]:
    """Poll tokenmill's /info until ``forward`` is no longer ``compiling``; its load stages then."""
    return CompiledWatch(server, timeout_s).result()


def tokenmill_system(cache_dir: Path, cgroup: Any = None, extra: tuple[str, ...] = ()) -> peers.System:
    """``tokenmill launch`` on ``cache_dir`` with ``extra`` flags; inside ``cgroup`` (``coldstart.Cgroup``) if given."""

    def command(checkpoint: peers.Checkpoint, port: int, peers_dir: Path) -> list[str]:
        argv = [sys.executable, "-m", "tokenmill", "launch", "--hostname", "127.0.0.1", "--port", str(port), *extra]
        return ["env", "-u", "TORCHINDUCTOR_CACHE_DIR", "-u", "TORCH_EXTENSIONS_DIR",
                *(cgroup.wrap(argv) if cgroup else argv)]
    return peers.System("tokenmill", "tgi", peers.default_format(), command,
                        env={"TOKENMILL_CACHE_DIR": str(cache_dir)}, note="tokenmill launch (gunicorn), defaults")
