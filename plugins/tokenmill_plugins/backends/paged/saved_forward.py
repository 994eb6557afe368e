"""A compiled forward kept on disk, so that a restart loads it in seconds instead of compiling it again.

``torch.compile``'s ahead-of-time mode traces the model once into a graph whose inputs are the model and the
step's tensors (the weights are read from the model at every call, never stored in the file), and inductor's
compiled kernels ride along with it. The file is named by everything the graph depends on: the model's
config and dtype, whether its linear layers are packed, the versions of Python, torch, transformers and
tokenmill, the source of the modules the graph was traced through, and this CPU's instruction sets (the
kernels are compiled for them). A file that fails to load is removed, and the forward compiled again.
"""

from __future__ import annotations

import hashlib
import io
import logging
import platform
from pathlib import Path
from typing import Any

import torch
import transformers

import tokenmill
from tokenmill.model import cpu_linears
from tokenmill.model.loading import cache_dir
from tokenmill_plugins.backends.paged import attention

log = logging.getLogger(__name__)

TRACED_SOURCES = (Path(cpu_linears.__file__), Path(attention.__file__), Path(__file__).with_name("compiled.py"))
"""tokenmill's code that a saved graph was traced through, or calls by name (its operators)."""


def saved_forward_path(model: Any) -> Path:
    """Where ``model``'s compiled forward is kept for this machine: ``TOKENMILL_CACHE_DIR/compiled/``."""
    digest = hashlib.sha256()
    for part in (platform.python_version(), torch.__version__, transformers.__version__, tokenmill.__version__,
                 str(next(model.parameters()).dtype), str(cpu_linears.has_packed_linears(model)),
                 model.config.to_json_string(use_diff=False), cpu_flags(),
                 *(source.read_text() for source in TRACED_SOURCES)):
        digest.update(part.encode())
        digest.update(b"\0")
    name = str(getattr(model.config, "model_type", None) or "model")
    return cache_dir() / "compiled" / f"{name}-{digest.hexdigest()[:24]}.forward"


def cpu_flags() -> str:
    """This CPU's instruction sets as Linux lists them (torch's summary elsewhere): what compiled kernels need."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return f"{platform.machine()} {torch.backends.cpu.get_cpu_capability()}"


def load(path: Path) -> Any | None:
    """The compiled forward saved at ``path``, or None when there is none or it cannot be loaded (then removed)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        function = torch.compiler.load_compiled_function(io.BytesIO(data))
    except Exception as error:  # noqa: BLE001 - a stale or broken file is compiled again
        log.warning("the saved compiled forward %s could not be loaded (%s: %s); compiling it again", path,
                    type(error).__name__, error)
        path.unlink(missing_ok=True)
        return None
    function.disable_guard_check()
    return function


def save(function: Any, path: Path) -> None:
    """Keep ``function`` (an ahead-of-time compiled forward) at ``path``, written whole or not at all."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        function.save_compiled_function(str(path))
    except Exception as error:  # noqa: BLE001 - the server runs on; the next start compiles again
        log.warning("the compiled forward could not be saved to %s: %s: %s", path, type(error).__name__, error)

