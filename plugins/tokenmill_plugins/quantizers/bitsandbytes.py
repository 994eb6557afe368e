"""``bitsandbytes`` (int8), ``bitsandbytes-nf4`` and ``bitsandbytes-fp4``: quantize at load with bitsandbytes.

transformers' bitsandbytes integration swaps the linear layers while the weights load.
On CUDA the kernels are bitsandbytes' own and fast. On CPU it runs its built-in
kernels: its optimised CPU kernel would be fetched from a hub when first used, which an
offline server cannot do, so that is said once at load and bitsandbytes' per-call
warnings are silenced. (Measured on SmolLM2 here, nf4 still decodes faster than float32
at one request and about as fast at 32: ``python -m bench quant``.) bitsandbytes leaves the LM head
and the embeddings in full precision; tokenmill stores them in 8 bits (once when tied) after loading.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import torch

import tokenmill
from tokenmill.interfaces import Quantizer
from tokenmill.model.quant_linears import int8_head_and_embedding

log = logging.getLogger(__name__)

_CHATTY_LOGGERS = ("bitsandbytes.autograd._functions", "bitsandbytes.backends.cpu.ops")


class BitsAndBytesQuantizer(Quantizer):
    def __init__(self, name: str, description: str, settings: dict[str, Any]) -> None:
        self.name = name
        self.description = description
        self.settings = settings

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("bitsandbytes") is None:
            return "bitsandbytes is not installed: pip install 'tokenmill[bnb]'"
        return None

    def from_pretrained_kwargs(self, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
        from transformers import BitsAndBytesConfig

        if device.type == "cpu":
            log.warning("bitsandbytes runs its built-in CPU kernels: its optimised CPU kernel would be fetched "
                        "from a hub at run time, which this offline server does not do")
            for name in _CHATTY_LOGGERS:
                logging.getLogger(name).setLevel(logging.ERROR)
        settings = dict(self.settings)
        if settings.get("load_in_4bit"):
            settings["bnb_4bit_compute_dtype"] = dtype
        return {"quantization_config": BitsAndBytesConfig(**settings), "device_map": str(device)}

    def quantize(self, model: Any) -> str | None:
        # bitsandbytes leaves the LM head and the embeddings in full precision; on a small model they weigh most.
        return int8_head_and_embedding(model) + " to int8 (the linear layers were quantized while loading)"


@tokenmill.hookimpl
def tokenmill_quantizers() -> list[Quantizer]:
    return [
        BitsAndBytesQuantizer("bitsandbytes", "bitsandbytes LLM.int8() at load", {"load_in_8bit": True}),
        BitsAndBytesQuantizer("bitsandbytes-nf4", "bitsandbytes 4-bit NormalFloat at load",
                              {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}),
        BitsAndBytesQuantizer("bitsandbytes-fp4", "bitsandbytes 4-bit float at load",
                              {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4"}),
    ]
