"""``int8`` and ``int4``: quantize a full-precision checkpoint at load, no other library needed.

Both also store the LM head and the embedding table in 8 bits (once, when they are
tied), since on a small model the 49k-row table is a fifth of the weights.

- ``int8``: 8-bit weights with a scale per output channel. On CPU the activations are
  rounded to 8 bits too, per token, and multiplied in integers (``torch._int_mm``), faster
  than float32 here; on CUDA the layers are weight-only (``_weight_int8pack_mm``).
- ``int4``: round-to-nearest 4-bit codes with a scale and zero point per group of 128, 64
  or 32 input channels (the largest that divides the layer): tinygemm on CUDA, rebuilt by
  table lookup at each call on CPU. A layer no group size divides stays as it is.
"""

from __future__ import annotations

from typing import Any

import tokenmill
from tokenmill.interfaces import Quantizer
from tokenmill.model.quant_linears import (
    Int4Linear,
    Int8Linear,
    int4_group_size,
    int8_head_and_embedding,
    linear_layers,
    quantize_int4,
    replace_module,
)


class Int8Quantizer(Quantizer):
    name = "int8"
    description = "8-bit weights per output channel, quantized at load (int8 matmuls on CPU, weight-only on CUDA)"

    def quantize(self, model: Any) -> str | None:
        head_and_embedding = int8_head_and_embedding(model)
        layers = linear_layers(model)
        for name, linear in layers:
            replace_module(model, name, Int8Linear(linear.weight.detach(), linear.bias))
        return f"{len(layers)} linear layers, {head_and_embedding} to int8"


class Int4Quantizer(Quantizer):
    name = "int4"
    description = "4-bit weights per group of input channels, quantized at load (PyTorch's packed int4 kernels)"

    def quantize(self, model: Any) -> str | None:
        head_and_embedding = int8_head_and_embedding(model)
        done, kept = 0, []
        for name, linear in linear_layers(model, skip=("lm_head",)):
            group_size = int4_group_size(linear.in_features)
            if group_size is None:
                kept.append(name)
                continue
            codes, scales, zeros = quantize_int4(linear.weight.detach(), group_size)
            replace_module(model, name, Int4Linear(codes, scales, zeros, group_size, linear.bias, linear.weight.dtype))
            done += 1
        note = f"; {len(kept)} kept (no group size divides their inputs)" if kept else ""
        return f"{done} linear layers to int4{note}, {head_and_embedding} to int8"


@tokenmill.hookimpl
def tokenmill_quantizers() -> list[Quantizer]:
    return [Int8Quantizer(), Int4Quantizer()]
