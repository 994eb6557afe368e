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

Where the CPU has AVX512-BF16 and tokenmill's native kernels build, bfloat16 weights are laid out instead
for tokenmill's own kernel (``kernels/csrc/cpu_linear.cpp``): blocks of 16 output features whose input
pairs feed ``vdpbf16ps`` directly. Over SmolLM2's 211 layers on 2 cores (``python -m bench.linears``), the
matmuls of a whole forward take 12.8 ms against oneDNN's 23.3 at one row (21 GB/s of weights read against
12), 17.8 against 32.3 at 8, 117 against 129 at 64, and the same within noise at 256 and 1,024 rows
(bench/RESULTS.md, "Issue 44, sixth part").

A compiled forward calls every packed layer as one opaque operator, ``tokenmill::packed_linear`` (or
``tokenmill::blocked_linear``), whose weight is an input of the graph rather than a constant: so the graph is
compiled without freezing, and inductor's and AOTAutograd's caches keep it (a frozen graph's packed constants
cannot be saved), which makes the compile at a restart take ~10 s instead of ~60.

A packed layer keeps no dense ``weight``: code that needs the weights themselves (a
quantizer, sharding, adapters) runs before packing, or with ``--no-prepack-weights``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from tokenmill.kernels import native

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


_LIBRARY.define("blocked_linear(Tensor x, Tensor blocked_weight, Tensor? bias, int out_features, "
                "bool float_output) -> Tensor")


def _blocked_linear(x: torch.Tensor, blocked_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                    float_output: bool) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = native.blocked_linear(rows, blocked_weight, out_features, float_output)
    out = out.view(*x.shape[:-1], out_features)
    return out.add_(bias) if bias is not None else out


_LIBRARY.impl("blocked_linear", _blocked_linear, "CPU")


@torch.library.register_fake("tokenmill::blocked_linear")
def _(x: torch.Tensor, blocked_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int,
      float_output: bool) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features), dtype=torch.float32 if float_output else x.dtype)


def blocks_bfloat16(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is laid out for tokenmill's bfloat16 kernel rather than packed for oneDNN."""
    return weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0 and native.linear_unavailable_reason() is None


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward, on a weight held in oneDNN's layout or blocked for tokenmill's bfloat16 kernel.
    ``logits``: the layer is the LM head, whose outputs the blocked kernel then gives in float32: bfloat16
    rounds logits near 25 to steps of 0.125, and two close candidates to a tie that greedy breaks by id."""

    def __init__(self, linear: nn.Linear, logits: bool = False) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.blocked = blocks_bfloat16(weight)
        self.float_output = self.blocked and logits
        if self.blocked:
            packed = native.block_weight(weight)
        elif weight.dtype == torch.float32:
            packed = weight.to_mkldnn()
        else:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.register_buffer("packed_weight", packed, persistent=False)
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocked:
            if torch.compiler.is_compiling():
                return torch.ops.tokenmill.blocked_linear(x, self.packed_weight, self.bias, self.out_features,
                                                          self.float_output)
            return _blocked_linear(x, self.packed_weight, self.bias, self.out_features, self.float_output)
        if torch.compiler.is_compiling():
            return torch.ops.tokenmill.packed_linear(x, self.packed_weight, self.bias)
        return _packed_linear(x, self.packed_weight, self.bias)

    def extra_repr(self) -> str:
        layout = "blocked for tokenmill's bfloat16 kernel" if self.blocked else "oneDNN"
        logits = ", float32 outputs" if self.float_output else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"layout={layout}{logits}")


def packed_layout(model: nn.Module) -> str:
    """How :func:`pack_linears` lays out ``model``'s weights, in words (the load stage's detail)."""
    if blocks_bfloat16(next(model.parameters())):
        return "blocked for tokenmill's bfloat16 kernel"
    return "oneDNN layout for CPU"


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
    output_embeddings = getattr(model, "get_output_embeddings", lambda: None)()
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear(linear, logits=linear is output_embeddings))
    return len(targets)
