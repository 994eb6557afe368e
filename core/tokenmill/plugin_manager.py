"""The plugin manager: built-in plugins, entry-point plugins, and choosing by name."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
    "tokenmill_plugins.tool_parsers.tgi",
    "tokenmill_plugins.tool_parsers.hermes",
    "tokenmill_plugins.tool_parsers.llama3_json",
    "tokenmill_plugins.tool_parsers.mistral",
    "tokenmill_plugins.tool_parsers.qwen3_xml",
    "tokenmill_plugins.tool_parsers.pythonic",
    "tokenmill_plugins.reasoning_parsers.think_tags",
    "tokenmill_plugins.reasoning_parsers.granite",
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
    "tool_parser": "tokenmill_tool_parsers",
    "reasoning_parser": "tokenmill_reasoning_parsers",
}

FLAGS = {"quantizer": "--quantize", "tool_parser": "--tool-call-parser"}
"""The flag that picks each kind, where it is not ``--`` and the kind's name."""


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


class PluginManager(pluggy.PluginManager):
    """pluggy's manager, which also remembers the third-party plugins it had to leave out, and why."""

    def __init__(self) -> None:
        super().__init__("tokenmill")
        self.problems: dict[str, str] = {}
        """Plugin name -> one line: why it was left out, or which of its hooks failed."""


def build_plugin_manager(autoload: bool | None = None) -> PluginManager:
    """A manager with the hookspecs, the built-in plugins and (unless disabled) entry points.

    ``TOKENMILL_DISABLE_PLUGIN_AUTOLOAD=1`` loads no entry point; ``TOKENMILL_PLUGINS=a,b``
    loads only those (by entry point or distribution name). A third-party plugin that fails to
    import, was built for other hooks, or implements a hook this version does not have is left
    out with one line in the log; one whose hook raises later is named in one line (the first time) and
    skipped for that call. Either way the built-ins and the other plugins keep working."""
    pm = PluginManager()
    pm.add_hookspecs(hookspecs)
    for module_name in BUILTIN_PLUGINS:
        pm.register(importlib.import_module(module_name), name=module_name)
    if autoload is None:
        autoload = os.environ.get("TOKENMILL_DISABLE_PLUGIN_AUTOLOAD", "") in ("", "0", "false")
    if autoload:
        allowed = {name.strip() for name in os.environ.get("TOKENMILL_PLUGINS", "").split(",") if name.strip()}
        for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = entry_point.dist
            if allowed and entry_point.name not in allowed and (dist is None or dist.name not in allowed):
                continue
            load_entry_point(pm, entry_point)
    pm.check_pending()
    return pm


def load_entry_point(pm: PluginManager, entry_point: importlib.metadata.EntryPoint) -> None:
    name = entry_point.name
    dist = entry_point.dist
    source = f"{dist.name} {dist.version}" if dist is not None else entry_point.value
    if pm.get_plugin(name) is not None or pm.is_blocked(name):
        return
    try:
        plugin = entry_point.load()
    except Exception as error:  # noqa: BLE001 - any import failure leaves this plugin out, not the server
        leave_out(pm, name, source, f"failed to import: {type(error).__name__}: {error}")
        return
    refusal = version_unavailable_reason(plugin)
    if refusal:
        leave_out(pm, name, source, refusal)
        return
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as error:
        leave_out(pm, name, source, f"has a hook that does not fit: {error}")
        return
    unknown = [caller.name for caller in pm.get_hookcallers(plugin) or [] if caller.spec is None]
    if unknown:
        pm.unregister(plugin)
        leave_out(pm, name, source, f"implements {', '.join(unknown)}, which tokenmill's hooks "
                                    f"{hookspecs.HOOKS_VERSION} do not have")
        return
    guard_hooks(pm, plugin, name, source)


def leave_out(pm: PluginManager, name: str, source: str, why: str) -> None:
    pm.problems[name] = why
    log.error("plugin %s (%s) left out: %s", name, source, why)


def version_unavailable_reason(plugin: object) -> str | None:
    """Why ``plugin`` cannot load with these hooks, from its ``tokenmill_hooks_version``; None if it can."""
    wanted = getattr(plugin, "tokenmill_hooks_version", None)
    if wanted is None:
        return None
    ours = hookspecs.HOOKS_VERSION
    try:
        major, minor = (int(part) for part in str(wanted).split("."))
    except ValueError:
        return f"its tokenmill_hooks_version {wanted!r} is not major.minor"
    our_major, our_minor = (int(part) for part in ours.split("."))
    if not (hookspecs.OLDEST_MAJOR <= major < our_major or (major == our_major and minor <= our_minor)):
        return f"it was built for tokenmill hooks {wanted}; this tokenmill has hooks {ours}"
    return None


def guard_hooks(pm: PluginManager, plugin: object, name: str, source: str) -> None:
    """Make each hook of a third-party ``plugin`` log one line and step aside when it raises,
    instead of failing the call for every plugin (a list hook then offers nothing)."""
    for caller in pm.get_hookcallers(plugin) or []:
        for impl in caller.get_hookimpls():
            if impl.plugin is plugin:
                impl.function = guarded(impl.function, pm, name, source, caller.name)


def guarded(function: Callable[..., Any], pm: PluginManager, name: str, source: str, hook: str) -> Callable[..., Any]:
    empty: Any = [] if hook in KIND_HOOKS.values() or hook == "tokenmill_logits_processors" else None

    failures = 0

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal failures
        try:
            return function(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - one plugin's failure is its own
            failures += 1
            pm.problems[name] = f"hook {hook} raised {type(error).__name__}: {error} ({failures} calls so far)"
            (log.error if failures == 1 else log.debug)(
                "plugin %s (%s): hook %s raised %s: %s (skipped%s)", name, source, hook, type(error).__name__,
                error, "; its later failures are logged at debug level" if failures == 1 else "")
            return empty

    return call


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
    flag = FLAGS.get(kind, "--" + kind.replace("_", "-"))
    names = ", ".join(sorted({impl.name for impl, _ in candidates} | ({"auto"} if kind == "backend" else set())))
    for implementation, _source in candidates:
        if implementation.name == name:
            reason = implementation.unavailable_reason()
            if reason:
                raise PluginError(f"{flag} {name} is not available here: {reason} (choices: {names})")
            return implementation
    broken = getattr(pm, "problems", {})
    hint = "; ".join(f"plugin {plugin}: {why}" for plugin, why in broken.items())
    raise PluginError(f"unknown {flag} {name!r} (choices: {names})" + missing_package_hint(kind, name)
                      + (f"; left out or failing: {hint}" if hint else ""))


KNOWN_PACKAGES = {("backend", "vllm"): "tokenmill-vllm"}
"""Plugins that live in packages of their own: naming one without its package says which to install."""


def missing_package_hint(kind: str, name: str) -> str:
    """``; install ...`` for a plugin that a known package would bring, else nothing."""
    package = KNOWN_PACKAGES.get((kind, name))
    if package is None:
        return ""
    return (f"; --{kind} {name} comes with the {package} package: pip install {package} "
            f"(its source is plugins/packages/{package} in tokenmill's repository)")


@dataclass(frozen=True)
class Chosen:
    """The plugins one server runs with, checked to fit each other."""

    backend: Implementation
    attention: Implementation | None
    """None when the backend brings its own engine (``owns_engine``), as for ``kv_allocator``."""
    kv_allocator: Implementation | None
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
    if getattr(chosen_backend, "owns_engine", False):
        for flag, value in (("--attention", attention), ("--kv-allocator", kv_allocator), ("--block-size", block_size)):
            if value is not None:
                raise PluginError(f"{flag} does not apply to --backend {backend}, which runs its own engine")
        return Chosen(chosen_backend, None, None, choose(pm, "scheduler", scheduler), 0)
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
