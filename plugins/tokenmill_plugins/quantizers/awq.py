"""``awq``: checkpoints quantized by AWQ (AutoAWQ's ``gemm`` format, 4 bits, zero points).

The format, per linear layer:
- ``qweight`` int32 ``[in, out/8]``: eight 4-bit codes along the output, in AWQ's
  interleaved order (word nibble ``k`` holds column ``ORDER[k]`` of its eight).
- ``qzeros`` int32 ``[groups, out/8]``: zero points, packed the same way.
- ``scales`` ``[groups, out]``.

so ``W[o, i] = scales[g, o] * (code[i, o] - zero[g, o])`` with ``g = i // group_size``. The
layers run as :class:`~tokenmill.model.quant_linears.Int4Linear`. ``pack`` writes the format.
autoawq itself is not needed (it is deprecated upstream and pulls ~1 GB).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import tokenmill
from tokenmill.interfaces import Quantizer
from tokenmill.model.quant_linears import Int4Linear, PackedCheckpointQuantizer, quantize_int4

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""Which of a word's eight columns each nibble holds, low nibble first."""
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[n, m/8]`` → codes ``[n, m]`` in column order."""
    nibbles = (packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 0xF  # [n, m/8, 8] in nibble order
    columns = torch.empty_like(nibbles)
    columns[..., list(ORDER)] = nibbles
    return columns.reshape(packed.shape[0], -1)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    rows, columns = codes.shape
    grouped = codes.to(torch.int64).reshape(rows, columns // 8, 8)[..., list(ORDER)]
    words = (grouped << torch.arange(0, 32, 4, dtype=torch.int64)).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """A float weight ``[out, in]`` as AWQ tensors, rounded to nearest (no activation-aware scaling)."""
    codes, scales, zeros = quantize_int4(weight, group_size)
    return {"qweight": pack_codes(codes.t().contiguous()), "qzeros": pack_codes(zeros.t().to(torch.int32)),
            "scales": scales.t().contiguous().to(torch.float16)}


def layer(tensors: dict[str, torch.Tensor], linear: nn.Linear, group_size: int, dtype: torch.dtype) -> Int4Linear:
    group_size = group_size if group_size > 0 else linear.in_features  # -1: one group per output channel
    codes = unpack(tensors["qweight"]).t().contiguous()
    zeros = unpack(tensors["qzeros"]).t()
    return Int4Linear(codes, tensors["scales"].t().float(), zeros, group_size, tensors.get("bias"), dtype)


class AwqQuantizer(PackedCheckpointQuantizer, Quantizer):
    name = "awq"
    checkpoint_method = "awq"
    description = "AWQ 4-bit checkpoints, gemm format (read by tokenmill, run by PyTorch's int4 kernels)"

    def group_size(self, config: dict[str, Any]) -> int:
        version = str(config.get("version", "gemm")).lower()
        if config.get("bits", config.get("w_bit", 4)) != 4 or version != "gemm":
            raise ValueError(f"only 4-bit AWQ checkpoints in the gemm format are supported (this one: {config})")
        if not config.get("zero_point", True):
            raise ValueError("AWQ checkpoints without zero points are not supported")
        return int(config.get("group_size", config.get("q_group_size", 128)))

    layer = staticmethod(layer)


@tokenmill.hookimpl
def tokenmill_quantizers() -> list[Quantizer]:
    return [AwqQuantizer()]
