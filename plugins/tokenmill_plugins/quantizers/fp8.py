"""``fp8``: float8 (e4m3) weights with a scale per output channel, quantized at load; CUDA only.

Each linear layer's activations are scaled to float8 per row at every call and
multiplied by ``torch._scaled_mm``, which needs a GPU with float8 tensor cores
(compute capability 8.9 or newer: Ada, Hopper, Blackwell). Elsewhere the quantizer is
unavailable and says why.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import tokenmill
from tokenmill.interfaces import Quantizer
from tokenmill.model.quant_linears import linear_layers, replace_module

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def _rowwise(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``tensor`` in float8 with one float32 scale per row (``[rows, 1]``)."""
    scales = (tensor.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    return (tensor.float() / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8), scales


class Fp8Linear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, scales = _rowwise(linear.weight.detach())
        self.register_buffer("weight_fp8", weight)
        self.register_buffer("weight_scales", scales.t().contiguous())  # [1, out]
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())
        self.out_dtype = linear.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows, row_scales = _rowwise(x.reshape(-1, self.in_features))
        # Row-wise scaled float8 matmuls produce bfloat16 only; the bias and the model's dtype come after.
        out = torch._scaled_mm(rows, self.weight_fp8.t(), scale_a=row_scales, scale_b=self.weight_scales,
                               out_dtype=torch.bfloat16)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.to(self.out_dtype).reshape(*shape[:-1], self.out_features)


class Fp8Quantizer(Quantizer):
    name = "fp8"
    description = "float8 e4m3 weights per output channel at load (CUDA, compute capability >= 8.9)"

    def unavailable_reason(self) -> str | None:
        if not torch.cuda.is_available():
            return "needs CUDA (a GPU with float8 tensor cores)"
        if torch.cuda.get_device_capability() < (8, 9):
            major, minor = torch.cuda.get_device_capability()
            return f"needs compute capability 8.9 or newer for float8 matmuls (this GPU has {major}.{minor})"
        return None

    def quantize(self, model: Any) -> str | None:
        layers = [(n, m) for n, m in linear_layers(model, skip=("lm_head",))
                  if m.in_features % 16 == 0 and m.out_features % 16 == 0]  # _scaled_mm's shape rule
        for name, linear in layers:
            replace_module(model, name, Fp8Linear(linear))
        return f"{len(layers)} linear layers to float8"


@tokenmill.hookimpl
def tokenmill_quantizers() -> list[Quantizer]:
    return [Fp8Quantizer()]
