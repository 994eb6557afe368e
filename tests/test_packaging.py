"""Packaging: a plain wheel, installed in a fresh venv that reuses the system torch, imports with its plugins."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import overlay_venv

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def run(*command: str, cwd: Path) -> str:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600,
                            env={"PATH": "/usr/bin:/bin", "TOKENMILL_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_wheel_installs_in_a_fresh_venv_with_its_builtin_plugins(tmp_path):
    source = tmp_path / "source"  # a copy, so that the build leaves nothing in the checkout
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__"))
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"),
        str(source), cwd=tmp_path)
    wheel = next((tmp_path / "dist").glob("tokenmill-*.whl"))
    python = str(overlay_venv(tmp_path / "venv"))  # sees this interpreter's torch etc., a venv's or not
    run(python, "-m", "pip", "install", "--no-deps", "--no-index", str(wheel), cwd=tmp_path)
    where = run(python, "-c", "import tokenmill, tokenmill_plugins; print(tokenmill.__file__)", cwd=tmp_path)
    assert str(tmp_path / "venv") in where, "the wheel's tokenmill is the one imported"
    source_of_kernels = run(python, "-c", "from tokenmill.kernels import native; "
                            "print(sorted(path.name for path in native.SOURCES.glob('*.cpp')))", cwd=tmp_path)
    assert source_of_kernels.strip() == "['cpu_linear.cpp', 'paged_decode.cpp', 'paged_prefill.cpp']", \
        "the native kernels' C++ source ships in the wheel"
    listing = run(str(tmp_path / "venv" / "bin" / "tokenmill"), "plugins", cwd=tmp_path)
    for name in ("transformers", "sdpa", "eager", "fifo", "dynamic"):
        assert name in listing
