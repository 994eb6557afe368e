"""The container's memory limit, read from fake cgroup trees: v2 and v1, nested groups, no limit."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import free_port

from bench.coldstart import make_cgroup
from tokenmill.model import kv_memory
from tokenmill.model.cgroup import ContainerMemory, container_memory

GiB = 2**30


def write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def v2_group(root: Path, group: str, limit: str, current: int, inactive_file: int = 0) -> None:
    base = f"sys/fs/cgroup{group}"
    write(root, f"{base}/memory.max", limit + "\n")
    write(root, f"{base}/memory.current", f"{current}\n")
    write(root, f"{base}/memory.stat", f"anon {current - inactive_file}\ninactive_file {inactive_file}\n")


def test_a_v2_container_sees_its_limit_less_its_working_set(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "0::/\n")  # a cgroup namespace: the group is the mount's root
    v2_group(tmp_path, "", str(4 * GiB), current=3 * GiB, inactive_file=GiB)
    memory = container_memory(tmp_path)
    assert memory == ContainerMemory(4 * GiB, 2 * GiB, tmp_path / "sys/fs/cgroup/memory.max")
    assert memory.available == 2 * GiB


def test_v2_max_means_no_limit(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "0::/user.slice/session-1.scope\n")
    v2_group(tmp_path, "/user.slice/session-1.scope", "max", current=GiB)
    v2_group(tmp_path, "/user.slice", "max", current=GiB)
    assert container_memory(tmp_path) is None


def test_a_parents_tighter_limit_binds(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "0::/kubepods/pod-a/container-b\n")
    v2_group(tmp_path, "/kubepods/pod-a/container-b", "max", current=GiB)
    v2_group(tmp_path, "/kubepods/pod-a", str(3 * GiB), current=2 * GiB)
    v2_group(tmp_path, "/kubepods", str(100 * GiB), current=50 * GiB)
    memory = container_memory(tmp_path)
    assert memory is not None
    assert (memory.limit, memory.available) == (3 * GiB, GiB)


def test_a_host_path_not_mounted_falls_back_to_the_mount_root(tmp_path: Path) -> None:
    # Docker without a cgroup namespace: /proc names the host's path, the mount shows only our group.
    write(tmp_path, "proc/self/cgroup", "0::/system.slice/docker-abc.scope\n")
    v2_group(tmp_path, "", str(2 * GiB), current=GiB // 2)
    memory = container_memory(tmp_path)
    assert memory is not None and memory.limit == 2 * GiB


def test_a_v1_container_sees_its_limit(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "12:cpu,cpuacct:/docker/abc\n11:memory:/docker/abc\n0::/\n")
    base = "sys/fs/cgroup/memory/docker/abc"
    write(tmp_path, f"{base}/memory.limit_in_bytes", f"{6 * GiB}\n")
    write(tmp_path, f"{base}/memory.usage_in_bytes", f"{2 * GiB}\n")
    write(tmp_path, f"{base}/memory.stat", f"cache {GiB}\ntotal_inactive_file {GiB}\n")
    memory = container_memory(tmp_path)
    assert memory is not None
    assert (memory.limit, memory.used, memory.available) == (6 * GiB, GiB, 5 * GiB)


def test_v1s_huge_number_means_no_limit(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "11:memory:/\n")
    write(tmp_path, "sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n")
    write(tmp_path, "sys/fs/cgroup/memory/memory.usage_in_bytes", f"{GiB}\n")
    assert container_memory(tmp_path) is None


def test_no_cgroup_filesystem_means_no_limit(tmp_path: Path) -> None:
    assert container_memory(tmp_path) is None
    write(tmp_path, "proc/self/cgroup", "0::/\n")  # listed, but nothing mounted
    assert container_memory(tmp_path) is None


@pytest.mark.parametrize("container_available, expected", [(GiB, GiB), (64 * GiB, 16 * GiB)])
def test_the_kv_pool_sizes_from_the_smaller_of_container_and_host(
        monkeypatch: pytest.MonkeyPatch, container_available: int, expected: int) -> None:
    monkeypatch.setattr(kv_memory, "host_available_bytes", lambda: 16 * GiB)
    monkeypatch.setattr(kv_memory, "container_memory",
                        lambda: ContainerMemory(container_available + GiB, GiB, Path("memory.max")))
    assert kv_memory.available_memory_bytes() == expected


def test_a_server_in_a_limited_container_sizes_its_kv_pool_from_the_limit(tiny_model_dir, tmp_path):
    group = make_cgroup(3 * GiB)
    if isinstance(group, str):
        pytest.skip(f"no writable memory cgroup here to start a server in: {group}")
    port = free_port()
    command = group.wrap([sys.executable, "-m", "tokenmill", "launch", "--hostname", "127.0.0.1", "--port", str(port),
                          "--server", "uvicorn", "--model-id", str(tiny_model_dir), "--backend", "paged",
                          "--dtype", "float32"])
    log = tmp_path / "server.log"
    env = {**os.environ, "TOKENMILL_DISABLE_PLUGIN_AUTOLOAD": "1", "COMPILE_MODEL": "false"}
    with open(log, "wb") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and server.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        kv = httpx.get(f"http://127.0.0.1:{port}/info", timeout=10).json()["kv"]
    finally:
        server.terminate()
        server.wait(30)
        group.remove()
    text = log.read_text()
    assert "the container's memory limit binds" in text, text[-3000:]
    pool_line = next(line for line in text.splitlines() if "KV pool:" in line)
    pool_mib, allowed_mib = (float(part.split(" MiB")[0]) for part in pool_line.split("(")[1].split(" of "))
    assert allowed_mib <= 0.3 * 3 * 1024, pool_line  # --kv-memory-fraction of what the 3 GiB limit leaves
    assert pool_mib <= allowed_mib and kv["blocks_total"] > 0
