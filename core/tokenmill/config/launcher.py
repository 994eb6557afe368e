"""TGI's ``text-generation-launcher`` flags that tokenmill accepts without acting on them.

A TGI manifest moved to tokenmill keeps its flags. Those tokenmill implements are ordinary flags
of :class:`~tokenmill.config.Config`; the rest are here, each with what tokenmill does instead.
Given on the command line or in their environment variable, each is accepted and earns one
warning line at start, never an exit (see :func:`notices`). Environment variables of platforms
that start TGI (SageMaker's) are mapped onto tokenmill's in :func:`platform_environment`.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class LauncherFlag:
    """One of TGI's launcher flags that tokenmill accepts and leaves without effect."""

    name: str
    instead: str
    """What tokenmill does instead: the warning's second half."""
    takes_value: bool = True
    environment: bool = True
    """Whether TGI reads it from its upper-case environment variable too (all but ``--env``)."""
    short: str | None = None


LAUNCHER_FLAGS = (
    LauncherFlag("cuda_graphs", "tokenmill captures no CUDA graphs (the paged backend on CPU compiles its forward "
                                "instead: --compile-model)"),
    LauncherFlag("shard_uds_path", "shards talk over torch.distributed (--master-addr, --master-port), not unix "
                                   "sockets"),
    LauncherFlag("weights_cache_override", "weights load as they are from the hub cache (--huggingface-hub-cache); "
                                           "nothing is converted"),
    LauncherFlag("rope_scaling", "the model's own rope_scaling from its config.json applies"),
    LauncherFlag("rope_factor", "the model's own rope_scaling from its config.json applies"),
    LauncherFlag("ngrok", "no tunnel is opened: expose --port yourself", takes_value=False),
    LauncherFlag("ngrok_authtoken", "no tunnel is opened: expose --port yourself"),
    LauncherFlag("ngrok_edge", "no tunnel is opened: expose --port yourself"),
    LauncherFlag("usage_stats", "tokenmill collects and sends no usage statistics"),
    LauncherFlag("disable_usage_stats", "tokenmill collects and sends no usage statistics", takes_value=False),
    LauncherFlag("disable_crash_reports", "tokenmill sends no crash reports", takes_value=False),
    LauncherFlag("enable_prefill_logprobs", "prompt logprobs (decoder_input_details, echo with logprobs) are "
                                            "always served", takes_value=False),
    LauncherFlag("env", "logs one warning line on the platform it runs on instead (python, torch, CUDA and GPUs, "
                        "OS, CPUs) and serves", takes_value=False, environment=False, short="-e"),
)
"""TGI's launcher flags (``launcher/src/main.rs``) that are not tokenmill's own."""


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def notices(given: Mapping[str, object]) -> tuple[str, ...]:
    """One line for each launcher flag in ``given`` (name → value, None when absent)."""
    lines = []
    for flag in LAUNCHER_FLAGS:
        value = given.get(flag.name)
        if value is None or value is False:
            continue
        if flag.name == "env":
            lines.append(f"--env: {runtime_summary()}")
            continue
        shown = flag_of(flag.name) + ("" if value is True else f" {value}")
        lines.append(f"{shown} is TGI's and has no effect in tokenmill: {flag.instead}")
    return tuple(lines)


def runtime_summary() -> str:
    """What TGI's ``--env`` prints: the platform this server runs on."""
    import torch

    cuda = f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)" if torch.cuda.is_available() else "no CUDA"
    return (f"python {platform.python_version()}, torch {torch.__version__}, {cuda}, "
            f"{platform.platform()}, {os.cpu_count()} CPUs")


SAGEMAKER_VARIABLES = (
    ("HF_MODEL_ID", "MODEL_ID"),
    ("HF_MODEL_REVISION", "REVISION"),
    ("SM_NUM_GPUS", "NUM_SHARD"),
    ("HF_MODEL_QUANTIZE", "QUANTIZE"),
    ("HF_MODEL_TRUST_REMOTE_CODE", "TRUST_REMOTE_CODE"),
)
"""SageMaker's variables and the flags' variables they set, as TGI's SageMaker entrypoint maps them."""


def platform_environment(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the platform variables TGI honours mapped onto tokenmill's: SageMaker's (a variable
    tokenmill reads itself wins) and TGI's legacy ``HF_API_TOKEN`` (as ``HF_TOKEN``)."""
    mapped = dict(env)
    for source, target in SAGEMAKER_VARIABLES:
        value = env.get(source, "")
        if source == "SM_NUM_GPUS" and (not value.isdigit() or int(value) < 1):
            continue  # a CPU instance says 0: leave --num-shard at its default
        if value and target not in env:
            mapped[target] = value
    if env.get("HF_API_TOKEN") and "HF_TOKEN" not in env:
        mapped["HF_TOKEN"] = env["HF_API_TOKEN"]
    return mapped
