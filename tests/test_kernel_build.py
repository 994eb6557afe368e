"""Building the native kernels: in tokenmill's cache, one process at a time, and never stuck on a lock
that a dead build left behind."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import torch

from tokenmill.kernels import native

HOLD_THE_LOCK = """
import sys, time
from pathlib import Path
from tokenmill.kernels.native import build_lock
with build_lock(Path(sys.argv[1])):
    print("holding", flush=True)
    time.sleep(600)
"""


def test_the_build_lives_in_tokenmills_cache_unless_torch_extensions_dir_is_set(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert native.build_directory("k") == tmp_path / "cache" / "kernels" / f"torch-{torch.__version__}" / "k"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "image"))
    assert native.build_directory("k") == tmp_path / "image" / "k"


def test_taking_the_lock_removes_the_baton_a_dead_build_left(tmp_path):
    directory = tmp_path / "build"
    directory.mkdir()
    (directory / "lock").write_text("")  # torch's builder waits for this file to go, for ever
    with native.build_lock(directory):
        assert not (directory / "lock").exists()


def test_the_lock_is_exclusive_and_dies_with_its_holder(tmp_path):
    directory = tmp_path / "build"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_THE_LOCK, str(directory)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        waiter = subprocess.Popen([sys.executable, "-c", HOLD_THE_LOCK.replace("600", "0"), str(directory)],
                                  stdout=subprocess.PIPE, text=True)
        time.sleep(3)
        assert waiter.poll() is None, "a second builder waits while the first holds the lock"
        holder.send_signal(signal.SIGKILL)  # a build killed midway: no cleanup runs
        assert waiter.communicate(timeout=60)[0].strip() == "holding"
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.skipif(native.native_unavailable_reason() is not None, reason="the native kernels cannot build here")
def test_a_stale_baton_in_the_real_build_directory_does_not_hang_the_load(tmp_path):
    name, _ = native._compiler_flags()
    stale = native.build_directory(name) / "lock"
    stale.write_text("")
    probe = "from tokenmill.kernels import native; print(native.native_unavailable_reason())"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert result.stdout.strip() == "None", result.stderr[-2000:]
    assert not stale.exists()
