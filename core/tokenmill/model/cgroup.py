"""The memory limit of the container this process runs in, read from its cgroup (v2 or v1).

Inside a container ``/proc/meminfo`` describes the host: a pod limited to 4 GiB on a 256 GiB node
sees 256 GiB there, and a pool sized from it gets the pod OOM-killed. The cgroup says what the
kernel will really allow: its ``memory.max`` (v2) or ``memory.limit_in_bytes`` (v1), and what the
group already uses. A limit set on a parent group binds too, so every level up to the root is read
and the tightest one wins.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

UNLIMITED_V1 = 1 << 60
"""cgroup v1 writes "no limit" as a huge page-aligned number (9223372036854771712 on x86-64)."""


@dataclass(frozen=True)
class ContainerMemory:
    """A cgroup's memory limit and what the group uses of it, in bytes."""

    limit: int
    used: int
    """The working set: usage less the page cache the kernel can drop (``inactive_file``), as
    Kubernetes counts it for eviction and the OOM killer reclaims before it kills."""
    source: Path
    """The file the limit was read from."""

    @property
    def available(self) -> int:
        return max(0, self.limit - self.used)


def container_memory(root: Path = Path("/")) -> ContainerMemory | None:
    """The tightest memory limit over this process's cgroup and its parents, or None when no
    level sets one (or there is no cgroup filesystem). ``root`` is ``/`` but for tests."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":
            limits += _limits(root / "sys/fs/cgroup", path, V2)
        elif "memory" in controllers.split(","):
            limits += _limits(root / "sys/fs/cgroup/memory", path, V1)
    return min(limits, key=lambda memory: memory.available, default=None)


def _levels(mount: Path, path: str) -> list[Path]:
    """The group's directory and each parent's, up to the mount; a container that sees only its own
    group (a cgroup namespace, or the host's path not mounted) has it at the mount itself."""
    parts = [part for part in path.strip().split("/") if part]
    levels = [mount.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]
    return [level for level in levels if level.is_dir()]


@dataclass(frozen=True)
class Layout:
    """Where one cgroup version keeps a group's limit, usage and droppable page cache."""

    limit: str
    usage: str
    inactive_key: str
    """The ``memory.stat`` line of page cache the kernel can drop."""


V2 = Layout("memory.max", "memory.current", "inactive_file")
V1 = Layout("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")


def _limits(mount: Path, path: str, layout: Layout) -> list[ContainerMemory]:
    found = []
    for level in _levels(mount, path):
        limit = _read_int(level / layout.limit)
        # v2 writes "max" where a level sets no limit (the root has no such file); v1 a huge number
        if limit is None or limit >= UNLIMITED_V1:
            continue
        used = _read_int(level / layout.usage) or 0
        found.append(ContainerMemory(limit, _working_set(used, level / "memory.stat", layout.inactive_key),
                                     level / layout.limit))
    return found


def _working_set(used: int, stat: Path, inactive_key: str) -> int:
    try:
        for line in stat.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == inactive_key and value.strip().isdigit():
                return max(0, used - int(value))
    except OSError:
        pass
    return used


def _read_int(file: Path) -> int | None:
    """The number in a cgroup file; None when it is missing, unreadable or says ``max``."""
    try:
        text = file.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
