"""``tokenmill plugins``: list the registered backends, attention kernels, schedulers, KV allocators and
quantizers, and the plugins that failed to load."""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.plugin_manager import build_plugin_manager, list_all


def list_plugins(argv: Sequence[str]) -> int:
    """One line per registered plugin (kind, name, available or why not, source), then the broken plugins."""
    pm = build_plugin_manager()
    rows = list_all(pm)
    width = max((len(r.name) for r in rows), default=4)
    print(f"{'kind':<13} {'name':<{width}}  {'status':<40} source")
    for row in rows:
        status = "available" if row.unavailable_reason is None else f"unavailable: {row.unavailable_reason}"
        print(f"{row.kind:<13} {row.name:<{width}}  {status:<40} {row.source}")
    for name, why in pm.problems.items():
        print(f"{'plugin':<13} {name:<{width}}  broken: {why}")
    return 0
