"""Linear layers with weights packed once for oneDNN, for float32 models on CPU.

``F.linear`` in float32 on CPU multiplies by the transposed weight as stored. oneDNN can
instead keep each weight in its own blocked layout, laid out for the order its kernel
reads it. On 2 cores, timing the matmuls of SmolLM2's 30 layers alone, that is about
1.5× faster at one token a step and 1.2× at 32, and the 49k-row LM head is 2× faster; a
whole decode step at batch 1 goes from 67 to 46 ms (``python -m bench latency``, with and
without ``--no-prepack-weights``). bfloat16 already goes through oneDNN's bf16 kernels, and
packing its weights too made decode slower: SmolLM2 compiled, 200-token prompts, a decode step
took 29.5 ms packed against 17.8 at batch 1, 58.9 against 53.9 at 32 and 103.4 against 104.8 at 64
(``python -m bench latency --batch-size 1 32 64 --sequence-length 200 --decode-length 16``, with a
one-off change that packed bf16 too). So only float32 models are packed.

A packed layer keeps no dense ``weight``: code that needs the weights themselves (a
quantizer, sharding, adapters) runs before packing, or with ``--no-prepack-weights``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward, on a weight held in oneDNN's layout."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.register_buffer("packed_weight", linear.weight.detach().to_mkldnn(), persistent=False)
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def packing_unavailable_reason(model: Any) -> str | None:
    """None when ``model``'s linear layers can be packed here, else why not."""
    parameter = next(model.parameters(), None)
    if parameter is None:
        return "the model has no parameters"
    if parameter.device.type != "cpu":
        return f"the model runs on {parameter.device.type}, not CPU"
    if parameter.dtype != torch.float32:
        return f"the model is {str(parameter.dtype).replace('torch.', '')} (bfloat16 and float16 already use oneDNN)"
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this torch build has no oneDNN linear kernel"
    if getattr(model, "hf_quantizer", None) is not None:
        return "the model is quantized"
    if not any(type(m) is nn.Linear and m.weight.dtype == torch.float32 for m in model.modules()):
        return "no float32 linear layer is left (a quantizer replaced them)"
    return None


def pack_linears(model: nn.Module) -> int:
    """Replace every plain float32 ``nn.Linear`` in ``model`` by a :class:`PackedLinear`;
    returns how many were replaced. A weight shared with another module (a tied LM head)
    is copied into the packed layout and stays in place for the other module."""
    targets = [(name, module) for name, module in model.named_modules()
               if type(module) is nn.Linear and module.weight.dtype == torch.float32]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear(linear))
    return len(targets)
