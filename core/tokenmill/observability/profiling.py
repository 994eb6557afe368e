"""A py-spy flame graph of this process (what ``GET /debug/profile?seconds=N`` answers with ``--enable-profiling``)."""

from __future__ import annotations

import asyncio
import ctypes
import os
import tempfile
from pathlib import Path

MAX_SECONDS = 60
PR_SET_PTRACER, PR_SET_PTRACER_ANY = 0x59616D61, -1


class ProfileError(RuntimeError):
    """py-spy could not record a profile."""


def allow_tracing_by(tracer: int) -> None:
    """Under Yama's ptrace_scope 1 (most distributions) a process may not trace its parent unless
    the parent says so: let ``tracer`` (PR_SET_PTRACER_ANY: any process of this user; 0: none again)."""
    try:
        ctypes.CDLL("libc.so.6").prctl(PR_SET_PTRACER, tracer, 0, 0, 0)
    except OSError:
        pass


async def record_flame_graph(py_spy: str, seconds: int) -> bytes:
    with tempfile.TemporaryDirectory(prefix="tokenmill-profile-") as folder:
        output = Path(folder) / "profile.svg"
        allow_tracing_by(PR_SET_PTRACER_ANY)  # only while the profile records
        try:
            process = await asyncio.create_subprocess_exec(
                py_spy, "record", "--pid", str(os.getpid()), "--duration", str(seconds), "--format", "flamegraph",
                "--output", str(output), "--nonblocking", "--idle",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
            log, _ = await process.communicate()
        finally:
            allow_tracing_by(0)
        if process.returncode != 0 or not output.exists():
            lines = log.decode(errors="replace").strip().splitlines()
            detail = next((line for line in lines if line.startswith("Error")), lines[0] if lines else "no output")
            raise ProfileError(f"py-spy failed: {detail}")
        return output.read_bytes()
