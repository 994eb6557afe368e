"""The quantizer kind: what makes a model's weights smaller."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenmill.interfaces.base import Implementation

if TYPE_CHECKING:
    import torch


class Quantizer(Implementation):
    """Makes the model's weights smaller, at load or by reading a checkpoint quantized elsewhere.

    A quantizer of pre-quantized checkpoints names the ``quant_method`` of the
    ``quantization_config`` it reads (``checkpoint_method``: gptq, awq) and builds the
    model itself in ``load``; the others let the model load as usual, with
    ``from_pretrained_kwargs`` added, then change it in place in ``quantize``.
    """

    kind = "quantizer"
    checkpoint_method: str | None = None

    def load(self, path: Any, dtype: torch.dtype, device: torch.device, attn_implementation: str,
             trust_remote_code: bool) -> Any:
        """The model of a checkpoint this quantizer reads itself, or None to load it as usual."""
        return None

    def from_pretrained_kwargs(self, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
        """Extra arguments for transformers' ``from_pretrained`` (a ``quantization_config``)."""
        return {}

    def quantize(self, model: Any) -> str | None:
        """Quantize a loaded model in place; a short detail for the load log, or None when there was nothing to do."""
        return None
