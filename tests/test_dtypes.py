"""--dtype auto: bfloat16 on CPUs that compute it natively, float32 elsewhere, the reason stated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import start_server
from tokenmill.config import ConfigError, parse_config
from tokenmill.model.dtypes import checkpoint_dtype, choose_dtype, native_bf16_instructions

CPU = torch.device("cpu")


def test_auto_on_a_cpu_with_native_bf16_is_bfloat16():
    choice = choose_dtype(None, CPU, "float32", native_bf16="AVX512-BF16")
    assert choice.dtype == torch.bfloat16
    assert "natively (AVX512-BF16)" in choice.reason


def test_auto_on_a_cpu_without_native_bf16_is_float32():
    choice = choose_dtype("auto", CPU, "float32", native_bf16=None)
    assert choice.dtype == torch.float32
    assert "no native bfloat16" in choice.reason


@pytest.mark.parametrize("native, expected", [("AMX", torch.bfloat16), (None, torch.float32)])
def test_a_float16_checkpoint_never_runs_in_float16_on_cpu(native, expected):
    choice = choose_dtype(None, CPU, "float16", native_bf16=native)
    assert choice.dtype == expected
    assert "the checkpoint is float16" in choice.reason


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_an_explicit_dtype_is_kept(name):
    choice = choose_dtype(name, CPU, "float32", native_bf16="AMX")
    assert choice.name == name and choice.reason == f"--dtype {name}"


def test_the_probe_agrees_with_the_cpu_flags():
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    has = "avx512_bf16" in flags.split() or "amx_bf16" in flags.split()
    assert (native_bf16_instructions() is not None) == has


def test_the_checkpoint_dtype_comes_from_its_config(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    assert checkpoint_dtype(tmp_path) == "float16"
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    assert checkpoint_dtype(tmp_path) == "bfloat16"
    assert checkpoint_dtype(tmp_path / "missing") is None


def test_dtype_auto_is_accepted_and_a_typo_is_refused():
    assert parse_config(["--dtype", "auto"], env={}).dtype == "auto"
    assert parse_config([], env={"DTYPE": "float32"}).dtype == "float32"
    with pytest.raises(ConfigError, match="--dtype must be auto, float16, bfloat16 or float32"):
        parse_config(["--dtype", "bf16"], env={})


def test_info_says_which_dtype_auto_chose_and_why(tiny_model_dir: Path, tmp_path: Path):
    server = start_server(["--model-id", str(tiny_model_dir), "--server", "uvicorn", "--max-total-tokens", "64"],
                          tmp_path)
    try:
        with server.client() as client:
            info = client.get("/info").json()
            generated = client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 3}})
    finally:
        server.stop()
    expected = "bfloat16" if native_bf16_instructions() else "float32"
    assert info["model_dtype"] == expected
    assert info["model_dtype_reason"].startswith("auto: this CPU")
    assert generated.status_code == 200 and generated.json()["generated_text"]
    assert f"dtype {expected} (auto: this CPU" in server.log()
