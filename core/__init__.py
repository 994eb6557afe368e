"""tokenmill: an LLM inference server with TGI's HTTP API on a pluggy plugin core."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

import pluggy

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("tokenmill")
"""Marker for plugin hook implementations: ``@tokenmill.hookimpl``."""

MOVED_MODULES = {
    "tokenmill.accelerators": "tokenmill.kernels.accelerators",
    "tokenmill.admission": "tokenmill.engine.admission",
    "tokenmill.chat": "tokenmill.http.openai.chat",
    "tokenmill.cpu_linears": "tokenmill.model.cpu_linears",
    "tokenmill.detokenizer": "tokenmill.engine.detokenizer",
    "tokenmill.grammar": "tokenmill.sampling.grammar",
    "tokenmill.http_body": "tokenmill.http.body",
    "tokenmill.kv_memory": "tokenmill.model.kv_memory",
    "tokenmill.loading": "tokenmill.model.loading",
    "tokenmill.logs": "tokenmill.observability.logs",
    "tokenmill.lora": "tokenmill.model.adapters",  # which re-exports tokenmill.model.lora
    "tokenmill.metrics": "tokenmill.observability.metrics",
    "tokenmill.middleware": "tokenmill.http.middleware",
    "tokenmill.native_kernels": "tokenmill.kernels.native",
    "tokenmill.openai_api": "tokenmill.http.openai",
    "tokenmill.plugins": "tokenmill.plugin_manager",
    "tokenmill.prefix": "tokenmill.engine.prefix",
    "tokenmill.profiling": "tokenmill.observability.profiling",
    "tokenmill.quant_linears": "tokenmill.model.quant_linears",
    "tokenmill.sequence": "tokenmill.engine.sequence",
    "tokenmill.serve": "tokenmill.http.serve",
    "tokenmill.server": "tokenmill.http.app",
    "tokenmill.sharding": "tokenmill.model.sharding",
    "tokenmill.startup": "tokenmill.engine.startup",
    "tokenmill.telemetry": "tokenmill.observability.telemetry",
    "tokenmill.tracing": "tokenmill.observability.tracing",
    "tokenmill.validation": "tokenmill.http.validation",
    "tokenmill.watermark": "tokenmill.sampling.watermark",
}
"""Import paths of modules that moved into subpackages, and where they live now. The old path
gives the very same module object, so plugins written against it (and ``monkeypatch`` targets)
keep working."""


def moved_name(name: str) -> str | None:
    """Where module ``name`` lives now, if it is an old path or a submodule of one, else None."""
    old = name
    while old not in MOVED_MODULES:
        old, dot, _ = old.rpartition(".")
        if not dot:
            return None
    return MOVED_MODULES[old] + name[len(old):]


class _MovedModuleLoader(importlib.abc.InspectLoader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return types.ModuleType(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        # The import system returns what sys.modules holds after this call: the moved module itself.
        sys.modules[module.__name__] = importlib.import_module(self.target)

    def get_source(self, fullname: str) -> str | None:  # for ``python -m tokenmill.<old path>``
        spec = importlib.util.find_spec(self.target)
        loader = spec.loader if spec is not None else None
        return loader.get_source(self.target) if isinstance(loader, importlib.abc.InspectLoader) else None


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        moved = moved_name(name) if name.startswith("tokenmill.") else None
        if moved is None:
            return None
        return importlib.machinery.ModuleSpec(name, _MovedModuleLoader(moved))


if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModuleFinder())


def __getattr__(name: str) -> types.ModuleType:
    """``tokenmill.<old module>`` as an attribute, e.g. after ``import tokenmill``."""
    if f"tokenmill.{name}" in MOVED_MODULES:
        return importlib.import_module(f"tokenmill.{name}")
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")


__all__ = ["MOVED_MODULES", "__version__", "hookimpl"]
