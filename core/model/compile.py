"""Whether the model's forward is compiled (torch.compile) with these settings, and asking the runner to."""

from __future__ import annotations

import logging
import os
import shutil
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.config import Config
    from tokenmill.model.loading import LoadedModel

log = logging.getLogger(__name__)


def compile_unavailable_reason(config: Config, loaded: LoadedModel, runner: Any) -> str | None:
    """Why the model forward is not compiled with these settings, or None."""
    if not hasattr(runner, "compile_forward"):
        return "the backend runs its forward eagerly"
    if config.num_shard > 1:
        return "a sharded forward (--num-shard) is not compiled"
    if loaded.quantization is not None:
        return "quantized layers are not compiled"
    return runner.compile_unavailable_reason()


def try_compile(config: Config, loaded: LoadedModel, runner: Any) -> bool:
    """Have ``runner`` compile its forward where it can (the warm-up then compiles it); whether it will."""
    reason = compile_unavailable_reason(config, loaded, runner)
    if reason:
        log.info("the forward runs eagerly: %s", reason)
        return False
    runner.compile_forward()
    return True


def inductor_unavailable_reason() -> str | None:
    """Why inductor cannot build compiled CPU code here (it calls ``CXX``, else g++), or None."""
    compiler = os.environ.get("CXX") or "g++"
    if shutil.which(compiler) is None:
        return f"inductor needs a C++ compiler and {compiler} is not on PATH"
    return None
