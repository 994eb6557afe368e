"""``gptq``: checkpoints quantized by GPTQ (AutoGPTQ / GPTQModel's ``gptq`` format, 4 bits).

The format, per linear layer:
- ``qweight`` int32 ``[in/8, out]``: eight 4-bit codes along the input, the first in the low bits.
- ``qzeros`` int32 ``[groups, out/8]``: eight zero points along the output, each stored minus one.
- ``scales`` ``[groups, out]``.
- ``g_idx`` int32 ``[in]``: each input channel's group, in act-order (``desc_act``) checkpoints
  not sorted.

so ``W[o, i] = scales[g, o] * (code[i, o] - (zero[g, o] + 1))`` with ``g = g_idx[i]``. The
layers run as :class:`~tokenmill.model.quant_linears.Int4Linear` (channels of act-order checkpoints
permuted so that groups are contiguous). ``pack`` writes the format, so tests and
benchmarks can make checkpoints without the GPTQ tools.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import tokenmill
from tokenmill.interfaces import Quantizer
from tokenmill.model.quant_linears import Int4Linear, PackedCheckpointQuantizer

BITS = 4
PER_WORD = 32 // BITS


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[n/8, m]`` → codes ``[n, m]``: word ``r`` holds rows ``8r .. 8r+7``, low bits first."""
    shifts = torch.arange(0, 32, BITS, dtype=torch.int32, device=packed.device)
    codes = (packed.unsqueeze(1) >> shifts[None, :, None]) & 0xF
    return codes.reshape(-1, packed.shape[1])


def unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[n, m/8]`` → codes ``[n, m]``: word ``c`` holds columns ``8c .. 8c+7``, low bits first."""
    shifts = torch.arange(0, 32, BITS, dtype=torch.int32, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(packed.shape[0], -1)


def pack_rows(codes: torch.Tensor) -> torch.Tensor:
    rows, columns = codes.shape
    grouped = codes.to(torch.int64).reshape(rows // PER_WORD, PER_WORD, columns)
    shifts = torch.arange(0, 32, BITS, dtype=torch.int64)[None, :, None]
    return _to_int32((grouped << shifts).sum(dim=1))


def pack_columns(codes: torch.Tensor) -> torch.Tensor:
    rows, columns = codes.shape
    grouped = codes.to(torch.int64).reshape(rows, columns // PER_WORD, PER_WORD)
    return _to_int32((grouped << torch.arange(0, 32, BITS, dtype=torch.int64)).sum(dim=-1))


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words as the int32 bit patterns the format stores."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """A float weight ``[out, in]`` as GPTQ tensors, rounded to nearest (no calibration)."""
    from tokenmill.model.quant_linears import quantize_int4

    codes, scales, zeros = quantize_int4(weight, group_size, lowest_zero=1)  # [out, in], [out, groups]
    return {
        "qweight": pack_rows(codes.t().contiguous()),
        "qzeros": pack_columns(zeros.t().to(torch.int32) - 1),
        "scales": scales.t().contiguous().to(torch.float16),
        "g_idx": torch.arange(weight.shape[1], dtype=torch.int32) // group_size,
    }


def layer(tensors: dict[str, torch.Tensor], linear: nn.Linear, group_size: int, dtype: torch.dtype) -> Int4Linear:
    group_size = group_size if group_size > 0 else linear.in_features  # -1: one group per output channel
    codes = unpack_rows(tensors["qweight"]).t()  # [out, in]
    zeros = (unpack_columns(tensors["qzeros"]) + 1).t()  # [out, groups]
    scales = tensors["scales"].t().float()
    g_idx = tensors.get("g_idx")
    order = None
    if g_idx is not None and bool((g_idx[1:] < g_idx[:-1]).any()):
        order = torch.argsort(g_idx.to(torch.int64), stable=True)
        codes = codes[:, order]
    bias = tensors.get("bias")
    return Int4Linear(codes.contiguous(), scales, zeros, group_size, bias, dtype, input_order=order)


class GptqQuantizer(PackedCheckpointQuantizer, Quantizer):
    name = "gptq"
    checkpoint_method = "gptq"
    description = "GPTQ 4-bit checkpoints (read by tokenmill, run by PyTorch's int4 kernels)"

    def group_size(self, config: dict[str, Any]) -> int:
        if config.get("bits", BITS) != BITS:
            raise ValueError(f"only {BITS}-bit GPTQ checkpoints are supported; this one has {config['bits']} bits")
        if config.get("checkpoint_format", "gptq") != "gptq":
            raise ValueError(f"GPTQ checkpoint format {config['checkpoint_format']!r} is not supported (only 'gptq')")
        return int(config.get("group_size", 128))

    layer = staticmethod(layer)


@tokenmill.hookimpl
def tokenmill_quantizers() -> list[Quantizer]:
    return [GptqQuantizer()]
