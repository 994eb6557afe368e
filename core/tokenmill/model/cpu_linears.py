"""Linear layers with weights packed once for oneDNN, for float32 and bfloat16 models on CPU.

``F.linear`` on CPU multiplies by the transposed weight as stored, laying it out for oneDNN's kernel at
every call. oneDNN can instead keep each weight in its own blocked layout, laid out once for the order
its kernel reads it. On 2 cores, timing the matmuls of SmolLM2's 30 layers alone in float32, that is
about 1.5× faster at one token a step and 1.2× at 32, and the 49k-row LM head is 2× faster; a whole
decode step at batch 1 goes from 67 to 46 ms (``python -m bench latency``, with and without
``--no-prepack-weights``). bfloat16 weights are packed as inductor packs them when it freezes a graph
(``mkldnn._reorder_linear_weight``): eagerly, a decode step of SmolLM2 took 56 ms at batch 1 and 156 ms
at 32, against 64 and 182 unpacked (``python -m bench.latency --no-compile-model --dtype bfloat16``).
(Packing bfloat16 with ``to_mkldnn()``, which keeps the plain layout, had made it slower.)

A compiled forward calls every packed layer as one opaque operator, ``tokenmill::packed_linear``, whose
weight is an input of the graph rather than a constant: so the graph is compiled without freezing, and
inductor's and AOTAutograd's caches keep it (a frozen graph's packed constants cannot be saved), which
makes the compile at a restart take ~10 s instead of ~60.

A packed layer keeps no dense ``weight``: code that needs the weights themselves (a
quantizer, sharding, adapters) runs before packing, or with ``--no-prepack-weights``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)


_LIBRARY = torch.library.Library("tokenmill", "FRAGMENT")
_LIBRARY.define("packed_linear(Tensor x, Tensor packed_weight, Tensor? bias) -> Tensor")


def _packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


for _key in ("CPU", "MkldnnCPU"):  # the packed weight's dispatch key is oneDNN's
    _LIBRARY.impl("packed_linear", _packed_linear, _key)


@torch.library.register_fake("tokenmill::packed_linear")
def _(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], packed_weight.size(0)))


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward, on a weight held in oneDNN's layout."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        packed = weight.to_mkldnn() if weight.dtype == torch.float32 else \
            torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.register_buffer("packed_weight", packed, persistent=False)
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.tokenmill.packed_linear(x, self.packed_weight, self.bias)
        return _packed_linear(x, self.packed_weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def has_packed_linears(model: nn.Module) -> bool:
    """Whether :func:`pack_linears` packed any of ``model``'s layers."""
    return any(isinstance(module, PackedLinear) for module in model.modules())


PACKED_DTYPES = (torch.float32, torch.bfloat16)


def packable(module: nn.Module) -> bool:
    """Whether :func:`pack_linears` replaces ``module``: a plain ``nn.Linear`` of a packed dtype."""
    return type(module) is nn.Linear and module.weight.dtype in PACKED_DTYPES


def packing_unavailable_reason(model: Any) -> str | None:
    """None when ``model``'s linear layers can be packed here, else why not."""
    parameter = next(model.parameters(), None)
    if parameter is None:
        return "the model has no parameters"
    if parameter.device.type != "cpu":
        return f"the model runs on {parameter.device.type}, not CPU"
    if parameter.dtype not in PACKED_DTYPES:
        return f"the model is {str(parameter.dtype).replace('torch.', '')} (only float32 and bfloat16 are packed)"
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this torch build has no oneDNN linear kernel"
    if parameter.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "this CPU has no oneDNN bfloat16 matmul"
    if getattr(model, "hf_quantizer", None) is not None:
        return "the model is quantized"
    if not any(packable(module) for module in model.modules()):
        return "no float32 or bfloat16 linear layer is left (a quantizer replaced them)"
    return None


def pack_linears(model: nn.Module) -> int:
    """Replace every plain float32 or bfloat16 ``nn.Linear`` in ``model`` by a :class:`PackedLinear`;
    returns how many were replaced. A weight shared with another module (a tied LM head)
    is copied into the packed layout and stays in place for the other module."""
    targets = [(name, module) for name, module in model.named_modules() if packable(module)]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear(linear))
    return len(targets)
