"""``GET /debug/profile?seconds=N`` (``--enable-profiling``): a py-spy flame graph of this process."""

from __future__ import annotations

import asyncio
import ctypes
import os
import shutil
import tempfile
from pathlib import Path

import falcon.asgi

from tokenmill.http.body import ApiError

MAX_SECONDS = 60
PR_SET_PTRACER, PR_SET_PTRACER_ANY = 0x59616D61, -1


def allow_tracing_by(tracer: int) -> None:
    """Under Yama's ptrace_scope 1 (most distributions) a process may not trace its parent unless
    the parent says so: let ``tracer`` (PR_SET_PTRACER_ANY: any process of this user; 0: none again)."""
    try:
        ctypes.CDLL("libc.so.6").prctl(PR_SET_PTRACER, tracer, 0, 0, 0)
    except OSError:
        pass


class ProfileRoute:
    """Samples every thread of the server (the engine's forward included, and threads that wait:
    an idle server still gives a graph) for ``seconds`` (1-60, default 10) and answers the SVG.
    One profile at a time."""

    def __init__(self) -> None:
        self.busy = asyncio.Lock()

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        py_spy = shutil.which("py-spy")
        if py_spy is None:
            raise ApiError(501, "profiling needs py-spy: pip install 'tokenmill[profile]'", "unavailable")
        try:
            seconds = int(req.get_param("seconds") or 10)
        except ValueError:
            raise ApiError(422, "seconds must be a whole number", "validation") from None
        if not 1 <= seconds <= MAX_SECONDS:
            raise ApiError(422, f"seconds must be between 1 and {MAX_SECONDS} (got {seconds})", "validation")
        if self.busy.locked():
            raise ApiError(429, "a profile is being recorded already", "overloaded")
        async with self.busy:
            resp.data = await record_flame_graph(py_spy, seconds)
        resp.content_type = "image/svg+xml"


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
            raise ApiError(500, f"py-spy failed: {detail}", "profiling")
        return output.read_bytes()
