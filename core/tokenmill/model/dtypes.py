"""Which dtype the weights run in: ``--dtype`` when given, else the fastest one this device computes
natively (``auto``), and why.

On CPU, bfloat16 halves the bytes every matmul reads and, where the CPU has bfloat16 instructions
(AVX512-BF16 or AMX), oneDNN multiplies it at about 2.3× float32's rate (on this project's 2-core
machines, 409 GFLOP/s against 176). Without those instructions bfloat16 is emulated and slower than
float32, so ``auto`` keeps float32 there. float16 has no fast CPU kernels at all: a float16
checkpoint runs in bfloat16 (same size, float32's range) or float32. vLLM's CPU build defaults to
bfloat16 on every x86 CPU; TGI's CPU image and Intel's extension take bfloat16 where the CPU has it
natively, as ``auto`` does.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

NAMES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str
    """One line for the start-up log and ``/info``: what decided it."""

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def native_bf16_instructions() -> str | None:
    """The CPU's bfloat16 instructions that oneDNN uses ("AMX", "AVX512-BF16"), or None when this CPU
    only emulates bfloat16."""
    cpu = torch.cpu
    if getattr(cpu, "_is_amx_tile_supported", lambda: False)():
        return "AMX"
    if getattr(cpu, "_is_avx512_bf16_supported", lambda: False)():
        return "AVX512-BF16"
    return _cpuinfo_bf16()


def _cpuinfo_bf16() -> str | None:
    """The same answer from /proc/cpuinfo's flags, for a torch without the probes above."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    if "amx_bf16" in flags:
        return "AMX"
    return "AVX512-BF16" if "avx512_bf16" in flags else None


def checkpoint_dtype(path: Path | None) -> str | None:
    """The dtype the checkpoint's ``config.json`` says its weights are stored in (``dtype``, or the older
    ``torch_dtype``), or None when it says none."""
    if path is None or not (Path(path) / "config.json").is_file():
        return None
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    stored = config.get("dtype") or config.get("torch_dtype")
    return stored if stored in NAMES else None


def checkpoint_choice(requested: str | None, device: torch.device, path: Path) -> DtypeChoice:
    """:func:`choose_dtype` for the checkpoint at ``path`` (its stored dtype read from its config), logged."""
    choice = choose_dtype(requested, device, checkpoint_dtype(path))
    log.info("dtype %s (%s)", choice.name, choice.reason)
    return choice


def choose_dtype(requested: str | None, device: torch.device, stored: str | None = None,
                 native_bf16: str | None | bool = True) -> DtypeChoice:
    """The weights' dtype: ``requested`` (``--dtype``; None or "auto" chooses) on ``device``, for a
    checkpoint stored in ``stored``. ``native_bf16`` is the CPU's bfloat16 instructions (True: probe them)."""
    if requested and requested != "auto":
        return DtypeChoice(getattr(torch, requested), f"--dtype {requested}")
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return DtypeChoice(torch.bfloat16, "auto: CUDA with bfloat16 support")
        return DtypeChoice(torch.float16, "auto: CUDA without bfloat16 support")
    if device.type != "cpu":
        return DtypeChoice(torch.float32, f"auto: {device.type}")
    instructions = native_bf16_instructions() if native_bf16 is True else native_bf16 or None
    stored_note = f"; the checkpoint is {stored}" if stored and stored != "float32" else ""
    if instructions:
        return DtypeChoice(torch.bfloat16, f"auto: this CPU computes bfloat16 natively ({instructions}){stored_note}")
    return DtypeChoice(torch.float32, f"auto: this CPU has no native bfloat16 (AVX512-BF16 or AMX){stored_note}")
