"""Which quantizer plugin loads the model: ``--quantize``'s, or the one that reads the checkpoint's own format."""

from __future__ import annotations

from typing import Any

import pluggy

from tokenmill.model.loading import ModelLoadError
from tokenmill.model.quant_linears import read_quantization_config
from tokenmill.plugin_manager import PluginError, choose, offered


def _readers_of(pm: pluggy.PluginManager, method: str) -> list[str]:
    return [impl.name for impl, _ in offered(pm, "quantizer") if getattr(impl, "checkpoint_method", None) == method]


def choose_quantizer(pm: pluggy.PluginManager, requested: str | None, path: Any) -> Any:
    """``--quantize``'s plugin, or the one for the checkpoint's own ``quant_method`` (as TGI does); None for neither."""
    found = read_quantization_config(path) if path.is_dir() else None
    method = (found or {}).get("quant_method")
    if requested and method and requested != method and requested not in _readers_of(pm, method):
        raise ModelLoadError(f"--quantize {requested} was given, but the checkpoint is already quantized with {method}")
    if requested is None and method is not None:  # the plugin that reads this checkpoint format
        readers = _readers_of(pm, method)
        if not readers:
            raise ModelLoadError(f"the checkpoint is quantized with {method!r}, which no quantizer plugin reads")
        requested = readers[0]
    if requested is None:
        return None
    try:
        return choose(pm, "quantizer", requested)
    except PluginError as error:
        raise ModelLoadError(str(error)) from None
