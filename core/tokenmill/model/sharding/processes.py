"""Ranks 1..N-1 as child processes of rank 0: their environment, the watch on them, and their end."""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__package__)  # the package's logger, as before the split


class ShardProcesses:
    """Ranks 1..N-1 started by rank 0 as child processes, watched, and never left behind."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.processes: list[Any] = []

    def start(self) -> None:
        import subprocess
        import sys

        config = self.config
        args = ["--num-shard", str(config.num_shard), "--master-addr", config.master_addr,
                "--master-port", str(config.master_port)]
        for flag, value in (("--model-id", config.model_id), ("--revision", config.revision),
                            ("--dtype", config.dtype)):
            if value:
                args += [flag, value]
        if config.trust_remote_code:
            args.append("--trust-remote-code")
        for rank in range(1, config.num_shard):
            env = shard_environment(rank, config.num_shard, config.master_addr, config.master_port)
            self.processes.append(subprocess.Popen([sys.executable, "-m", "tokenmill", "launch", *args], env=env))
        log.info("started %d shard processes (pids %s)", len(self.processes), [p.pid for p in self.processes])

    def first_exit(self) -> tuple[int, int] | None:
        """(rank, exit code) of a shard that has ended, or None while all run."""
        for rank, process in enumerate(self.processes, start=1):
            code = process.poll()
            if code is not None:
                return rank, code
        return None

    def stop(self, timeout: float = 10.0) -> None:
        import subprocess

        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()


def shard_environment(rank: int, world_size: int, master_addr: str, master_port: int) -> dict[str, str]:
    return {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "TOKENMILL_RANK0_PID": str(os.getpid())}


def die_with_parent() -> None:
    """A shard started by rank 0 asks Linux to end it when rank 0's process ends, however that ends
    (and ends now if that already happened)."""
    import ctypes
    import signal

    parent = os.environ.get("TOKENMILL_RANK0_PID")
    if parent is None:  # started by torchrun, which watches its ranks itself
        return
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != int(parent):
        os._exit(1)
