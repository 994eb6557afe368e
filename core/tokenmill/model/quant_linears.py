"""Quantized linear layers and the model surgery the quantizer plugins share.

Every quantizer ends in one of these layers, so the formats (GPTQ, AWQ, load-time
int4/int8) differ only in how they read their numbers:

- :class:`Int4Linear`: 4-bit codes with a scale and a zero point per group of input
  channels: tinygemm on CUDA; on CPU the weight is rebuilt by table lookup at each
  call (half a byte per weight at rest, slower than float32).
- :class:`Int8Linear`: 8-bit weights with a scale per output channel. On CPU times 8-bit
  activations (a scale per token, at each call) in integer arithmetic, faster than float32
  here; on CUDA weight-only (``_weight_int8pack_mm``).
- :class:`Int8Embedding`: an embedding table in 8 bits with a scale per row.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

INT4_GROUP_SIZES = (128, 64, 32)
"""Group sizes PyTorch's int4 kernels take (tinygemm on CUDA), largest (least scale overhead) first."""


def int4_group_size(in_features: int, wanted: int | None = None) -> int | None:
    """The group size to use for a layer with ``in_features`` inputs, or None when none fits."""
    choices = [wanted] if wanted else list(INT4_GROUP_SIZES)
    return next((g for g in choices if g in INT4_GROUP_SIZES and in_features % g == 0), None)


_BYTE = torch.arange(256)
NIBBLE_VALUES = torch.stack([_BYTE & 15, _BYTE >> 4], dim=-1).float()
"""The two 4-bit codes of each byte value, low nibble first: unpacking is one table lookup."""


class Int4Linear(nn.Module):
    """``y = x Wᵀ + b`` with ``W[o, i] = scale[o, g] * (code[o, i] - zero[o, g])``, ``g = i // group_size``.

    On CUDA the codes are in PyTorch's packed int4 layout for tinygemm (``_weight_int4pack_mm``).
    On CPU they are two per byte, and each call rebuilds the weight by table lookup (~1.6 ms
    for a 1536×576 layer) and multiplies in the model's dtype: PyTorch's CPU int4 kernel costs
    ~0.75 ms per input row here, which makes a prefill of thousands of tokens take minutes.
    ``input_order`` (GPTQ's act-order checkpoints) permutes the input channels so that groups
    are contiguous; the input is permuted the same way at each call.
    """

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None, dtype: torch.dtype, input_order: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.group_size = group_size
        self.compute_dtype = dtype
        self.tinygemm = codes.device.type == "cuda"
        scales = scales.float()
        offsets = -zeros.float() * scales
        if self.tinygemm:
            if group_size not in (32, 64, 128, 256) or self.in_features % 32:
                raise ValueError(f"tinygemm runs groups of 32, 64, 128 or 256 over inputs divisible by 32; this layer "
                                 f"has {self.in_features} inputs in groups of {group_size}")
            inner_k_tiles = next(t for t in (8, 4, 2) if self.in_features % (16 * t) == 0)
            packed = torch.ops.aten._convert_weight_to_int4pack(
                ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8), inner_k_tiles)
            # tinygemm computes (code - 8) * scale + offset: its offset is scale * (8 - zero).
            scales_and_offsets = torch.stack([scales.t(), (offsets + 8 * scales).t()], dim=-1).contiguous()
            self.register_buffer("packed", packed)
            self.register_buffer("scales_and_offsets", scales_and_offsets.to(torch.bfloat16))
        else:
            self.register_buffer("packed", (codes[:, ::2] | (codes[:, 1::2] << 4)).to(torch.uint8).contiguous())
            self.register_buffer("scales", scales.contiguous())
            self.register_buffer("offsets", offsets.contiguous())
        self.register_buffer("bias", None if bias is None else bias.to(dtype))
        self.register_buffer("input_order", input_order)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight ``[out, in]`` in the compute dtype, rebuilt from the codes (CPU layout)."""
        groups = self.in_features // self.group_size
        codes = nn.functional.embedding(self.packed.int(), NIBBLE_VALUES.to(self.packed.device))
        codes = codes.view(self.out_features, groups, self.group_size)
        weight = torch.addcmul(self.offsets.unsqueeze(-1), codes, self.scales.unsqueeze(-1))
        return weight.reshape(self.out_features, self.in_features).to(self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        if self.input_order is not None:
            rows = rows[:, self.input_order]
        if self.tinygemm:
            out = torch.ops.aten._weight_int4pack_mm(rows.to(torch.bfloat16), self.packed, self.group_size,
                                                     self.scales_and_offsets).to(x.dtype)
            if self.bias is not None:
                out = out + self.bias
        else:
            out = nn.functional.linear(rows.to(self.compute_dtype), self.dequantized_weight(), self.bias).to(x.dtype)
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"


def quantize_int4(weight: torch.Tensor, group_size: int,
                  lowest_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric 4-bit codes ``[out, in]`` (0..15), scales and zero points ``[out, groups]``
    (zero points at least ``lowest_zero``: GPTQ's format cannot store 0)."""
    out_features, in_features = weight.shape
    groups = weight.float().reshape(out_features, in_features // group_size, group_size)
    low, high = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)  # the range holds 0, as GPTQ/AWQ's do
    scales = ((high - low) / 15).clamp(min=1e-8)
    zeros = torch.round(-low / scales).clamp(lowest_zero, 15)
    codes = torch.round(groups / scales.unsqueeze(-1) + zeros.unsqueeze(-1)).clamp(0, 15)
    return codes.reshape(out_features, in_features).to(torch.int32), scales, zeros


def quantize_int8_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric 8-bit codes of a 2-D tensor with one float32 scale per row (weights per output
    channel, embeddings per token, activations per token)."""
    scales = (tensor.float().abs().amax(dim=1) / 127).clamp(min=1e-8)
    codes = torch.round(tensor.float() / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, scales


class Int8Linear(nn.Module):
    """8-bit weights, one scale per output channel.

    On CPU each call also rounds the activations to 8 bits, one scale per row (per token),
    and multiplies in integers (``torch._int_mm``): faster than float32 here, and per-row
    scales keep the error small where one scale for the whole batch (fbgemm's dynamic
    linear) let a few large activations swamp the rest. On CUDA the weights are
    dequantized inside the matmul (``_weight_int8pack_mm``), activations untouched.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        codes, scales = quantize_int8_rows(weight)
        self.integer_matmul = weight.device.type == "cpu"
        # [out, in] like the float weight, so a tied embedding can share it (_int_mm reads the transpose as fast).
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales if self.integer_matmul else scales.to(weight.dtype))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        if self.integer_matmul:
            quantized, row_scales = quantize_int8_rows(rows)
            out = (torch._int_mm(quantized, self.codes.t()).float() * row_scales[:, None] * self.scales).to(x.dtype)
        else:
            out = torch.ops.aten._weight_int8pack_mm(rows, self.codes, self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kernel = "int8 x int8" if self.integer_matmul else "weight-only"
        return f"in_features={self.in_features}, out_features={self.out_features}, {kernel}"


class Int8Embedding(nn.Module):
    """An embedding table in 8 bits, one scale per row; looked-up rows come back in ``dtype``.
    ``codes`` and ``scales`` may be those of an :class:`Int8Linear` LM head tied to the table."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                 padding_idx: int | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = codes.shape
        self.padding_idx = padding_idx
        self.dtype = dtype
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, padding_idx: int | None = None) -> Int8Embedding:
        codes, scales = quantize_int8_rows(weight)
        return cls(codes, scales, weight.dtype, padding_idx)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.codes[ids].float() * self.scales[ids].float().unsqueeze(-1)).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8"


def int8_head_and_embedding(model: nn.Module) -> str:
    """Store the LM head and the input embeddings in 8 bits, once for both when they are tied:
    on a small model with a large vocabulary they are most of what other quantizers leave in full precision."""
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    done = []
    if type(head) is nn.Linear:
        tied = type(embedding) is nn.Embedding and head.weight is embedding.weight
        quantized_head = Int8Linear(head.weight.detach(), head.bias)
        model.set_output_embeddings(quantized_head)
        done.append("the LM head")
        if tied:
            model.set_input_embeddings(Int8Embedding(quantized_head.codes, quantized_head.scales,
                                                     embedding.weight.dtype, embedding.padding_idx))
            done.append("the embeddings (shared)")
            return " and ".join(done)
    if type(embedding) is nn.Embedding:
        model.set_input_embeddings(Int8Embedding.from_weight(embedding.weight.detach(), embedding.padding_idx))
        done.append("the embeddings")
    return " and ".join(done) or "nothing"


# ---- model surgery -----------------------------------------------------------------------------------


def linear_layers(model: nn.Module, skip: tuple[str, ...] = ()) -> list[tuple[str, nn.Linear]]:
    """The model's plain ``nn.Linear`` layers by name, those whose name ends with one of ``skip`` left out."""
    return [(name, module) for name, module in model.named_modules()
            if type(module) is nn.Linear and not name.endswith(skip)]


def replace_module(model: nn.Module, name: str, replacement: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, replacement)


def weight_bytes(model: nn.Module) -> int:
    """Bytes held by parameters and buffers, each tensor counted once."""
    seen: set[int] = set()
    total = 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def read_quantization_config(path: Path) -> dict[str, Any] | None:
    """The ``quantization_config`` of a checkpoint's ``config.json``, or None."""
    config_file = path / "config.json"
    if not config_file.is_file():
        return None
    return json.loads(config_file.read_text()).get("quantization_config")


class PackedCheckpointQuantizer:
    """What the readers of pre-quantized checkpoints (GPTQ, AWQ) share: check the checkpoint's
    ``quantization_config``, then load it with each packed layer made by ``layer``. Mixed into a
    :class:`~tokenmill.interfaces.Quantizer` that names its ``checkpoint_method``."""

    checkpoint_method: str | None = None

    def group_size(self, config: dict[str, Any]) -> int:
        """The checkpoint's group size; raises ValueError for settings this reader cannot run."""
        raise NotImplementedError

    def layer(self, tensors: dict[str, torch.Tensor], linear: nn.Linear, group_size: int,
              dtype: torch.dtype) -> nn.Module:
        raise NotImplementedError

    def load(self, path: Path, dtype: torch.dtype, device: torch.device, attn_implementation: str,
             trust_remote_code: bool) -> nn.Module:
        config = read_quantization_config(path) or {}
        if config.get("quant_method") != self.checkpoint_method:
            raise ValueError(f"{path} is not a {str(self.checkpoint_method).upper()} checkpoint "
                             f"(its quantization_config: {config or 'none'})")
        group_size = self.group_size(config)
        return load_packed_checkpoint(path, dtype, device, attn_implementation, trust_remote_code,
                                      lambda tensors, linear: self.layer(tensors, linear, group_size, dtype))


def load_packed_checkpoint(path: Path, dtype: torch.dtype, device: torch.device, attn_implementation: str,
                           trust_remote_code: bool,
                           make_layer: Callable[[dict[str, torch.Tensor], nn.Linear], nn.Module]) -> nn.Module:
    """A model whose linear layers are stored packed (``<layer>.qweight`` and friends).

    The skeleton is built without allocating weights; every linear layer with packed
    tensors in the checkpoint becomes ``make_layer(tensors, linear)``, where ``tensors``
    maps the suffix (``qweight``, ``scales``...) to the tensor; the other weights
    (embeddings, norms, an unquantized head) load as they are.
    """
    from accelerate import init_empty_weights
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation,
                                                 trust_remote_code=trust_remote_code)
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(shard))
    if not tensors:
        raise ValueError(f"{path} holds no .safetensors weights")
    packed_layers = sorted({key.rsplit(".", 1)[0] for key in tensors if key.endswith(".qweight")})
    for name in packed_layers:
        parts = {key.rsplit(".", 1)[1]: tensors.pop(key).to(device) for key in list(tensors)
                 if key.rsplit(".", 1)[0] == name}
        replace_module(model, name, make_layer(parts, model.get_submodule(name)))
    plain = {key: value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)
             for key, value in tensors.items()}
    missing, unexpected = model.load_state_dict(plain, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
        missing = [key for key in missing if key != "lm_head.weight"]
    left_empty = [key for key in missing if any(t.is_meta for n, t in model.named_parameters() if n == key)]
    if left_empty or unexpected:
        raise ValueError(
            f"the checkpoint does not fit the model: missing {left_empty[:3]}, unexpected {unexpected[:3]}")
    return model.to(device).eval()


def write_packed_checkpoint(source: Path, target: Path, pack: Callable[[torch.Tensor, int], dict[str, torch.Tensor]],
                            quantization_config: dict[str, Any]) -> Path:
    """Write ``source`` (a full-precision checkpoint) to ``target`` with every linear layer but the LM
    head as ``pack(weight, group_size)`` tensors: a GPTQ or AWQ checkpoint without their tools (rounded
    to nearest, no calibration), for tests and benchmarks."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    group_size = quantization_config["group_size"]
    state = {key: value.contiguous() for key, value in model.state_dict().items()}
    for name, linear in linear_layers(model, skip=("lm_head",)):
        del state[f"{name}.weight"]
        for suffix, tensor in pack(linear.weight.detach(), group_size).items():
            state[f"{name}.{suffix}"] = tensor.contiguous()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    target.mkdir(parents=True, exist_ok=True)
    save_file(state, target / "model.safetensors", metadata={"format": "pt"})
    model.config.quantization_config = quantization_config
    model.config.save_pretrained(target)
    AutoTokenizer.from_pretrained(source).save_pretrained(target)
    return target
