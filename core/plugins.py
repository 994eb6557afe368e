"""The plugin manager: built-in plugins, entry-point plugins, and choosing by name."""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass

import pluggy

from tokenmill import hookspecs
from tokenmill.interfaces import Implementation

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "tokenmill"

BUILTIN_PLUGINS = (
    "tokenmill_plugins.backends.transformers",
    "tokenmill_plugins.backends.paged",
    "tokenmill_plugins.attention.torch_kernels",
    "tokenmill_plugins.attention.flash",
    "tokenmill_plugins.schedulers.fifo",
    "tokenmill_plugins.schedulers.priority",
    "tokenmill_plugins.kv.dynamic",
    "tokenmill_plugins.kv.paged",
    "tokenmill_plugins.quantizers.weight_only",
    "tokenmill_plugins.quantizers.gptq",
    "tokenmill_plugins.quantizers.awq",
    "tokenmill_plugins.quantizers.bitsandbytes",
    "tokenmill_plugins.quantizers.fp8",
)

AUTO_BACKENDS = ("flash", "paged", "transformers")
"""What ``--backend auto`` tries, in order: the first that can run here (and, once the model
is loaded, that can run it)."""

KIND_HOOKS = {
    "backend": "tokenmill_backends",
    "attention": "tokenmill_attention_kernels",
    "scheduler": "tokenmill_schedulers",
    "kv_allocator": "tokenmill_kv_allocators",
    "quantizer": "tokenmill_quantizers",
}


class PluginError(Exception):
    """A plugin choice that cannot be honoured; the message is one line for the operator."""


@dataclass(frozen=True)
class Offered:
    """One implementation as ``tokenmill plugins`` lists it."""

    kind: str
    name: str
    source: str
    description: str
    unavailable_reason: str | None


def build_plugin_manager(autoload: bool | None = None) -> pluggy.PluginManager:
    """A manager with the hookspecs, the built-in plugins and (unless disabled) entry points."""
    pm = pluggy.PluginManager("tokenmill")
    pm.add_hookspecs(hookspecs)
    for module_name in BUILTIN_PLUGINS:
        pm.register(importlib.import_module(module_name), name=module_name)
    if autoload is None:
        autoload = os.environ.get("TOKENMILL_DISABLE_PLUGIN_AUTOLOAD", "") in ("", "0", "false")
    if autoload:
        pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    pm.check_pending()
    return pm


def offered(pm: pluggy.PluginManager, kind: str) -> list[tuple[Implementation, str]]:
    """Every implementation of ``kind`` with the name of the plugin that offers it."""
    hook = getattr(pm.hook, KIND_HOOKS[kind])
    found: list[tuple[Implementation, str]] = []
    for impl in hook.get_hookimpls():
        source = pm.get_name(impl.plugin) or repr(impl.plugin)
        for implementation in impl.function() or []:
            found.append((implementation, source))
    return found


def list_all(pm: pluggy.PluginManager) -> list[Offered]:
    rows = []
    for kind in KIND_HOOKS:
        for implementation, source in offered(pm, kind):
            rows.append(
                Offered(
                    kind=kind,
                    name=implementation.name,
                    source=source,
                    description=implementation.description,
                    unavailable_reason=implementation.unavailable_reason(),
                )
            )
    return rows


def choose(pm: pluggy.PluginManager, kind: str, name: str) -> Implementation:
    """The implementation of ``kind`` called ``name``, or a PluginError listing the choices."""
    candidates = offered(pm, kind)
    flag = "--quantize" if kind == "quantizer" else "--" + kind.replace("_", "-")
    names = ", ".join(sorted({impl.name for impl, _ in candidates} | ({"auto"} if kind == "backend" else set())))
    for implementation, _source in candidates:
        if implementation.name == name:
            reason = implementation.unavailable_reason()
            if reason:
                raise PluginError(f"{flag} {name} is not available here: {reason} (choices: {names})")
            return implementation
    raise PluginError(f"unknown {flag} {name!r} (choices: {names})")


@dataclass(frozen=True)
class Chosen:
    """The plugins one server runs with, checked to fit each other."""

    backend: Implementation
    attention: Implementation
    kv_allocator: Implementation
    scheduler: Implementation
    block_size: int


def choose_all(pm: pluggy.PluginManager, backend: str, attention: str | None, kv_allocator: str | None,
               scheduler: str, block_size: int | None) -> Chosen:
    """Resolve every plugin flag; unset attention and KV allocator follow the backend's defaults.
    ``auto`` takes the first backend of AUTO_BACKENDS that works with the other flags."""
    if backend == "auto":
        reasons = []
        for name in AUTO_BACKENDS:
            try:
                return choose_all(pm, name, attention, kv_allocator, scheduler, block_size)
            except PluginError as error:
                reasons.append(str(error))
        raise PluginError("--backend auto found no backend that works here: " + "; ".join(reasons))
    chosen_backend = choose(pm, "backend", backend)
    layout = chosen_backend.kv_layout  # type: ignore[attr-defined]
    chosen_attention = choose(pm, "attention", attention or chosen_backend.default_attention)  # type: ignore[attr-defined]
    if layout not in chosen_attention.layouts:  # type: ignore[attr-defined]
        fitting = sorted(impl.name for impl, _ in offered(pm, "attention") if layout in impl.layouts)  # type: ignore[attr-defined]
        raise PluginError(f"--attention {chosen_attention.name} cannot serve the {layout} layout of --backend "
                          f"{chosen_backend.name} (choices: {', '.join(fitting)})")
    chosen_kv = choose(pm, "kv_allocator", kv_allocator or chosen_backend.default_kv_allocator)  # type: ignore[attr-defined]
    if chosen_kv.layout != layout:  # type: ignore[attr-defined]
        fitting = sorted(impl.name for impl, _ in offered(pm, "kv_allocator") if impl.layout == layout)  # type: ignore[attr-defined]
        raise PluginError(f"--kv-allocator {chosen_kv.name} cannot serve the {layout} layout of --backend "
                          f"{chosen_backend.name} (choices: {', '.join(fitting)})")
    multiple = chosen_attention.block_size_multiple  # type: ignore[attr-defined]
    size = block_size or max(16, multiple)
    if size % multiple:
        raise PluginError(f"--block-size {size} is not a multiple of {multiple}, which --attention "
                          f"{chosen_attention.name} needs")
    return Chosen(chosen_backend, chosen_attention, chosen_kv, choose(pm, "scheduler", scheduler), size)
