"""Models that answer with a vector or a score instead of text (``--task embed`` and ``--task score``).

An *embedding* model's last hidden states are pooled into one vector per input, the way its checkpoint
says: a sentence-transformers checkpoint names its modules in ``modules.json`` (the pooling in
``1_Pooling/config.json``, then optional ``Dense`` layers and ``Normalize``); any other checkpoint is
pooled on its last token when its model is a decoder (causal embedding models such as Qwen3-Embedding
or SmolLM2), on its first (CLS) token when it is an encoder, and normalized, as vLLM does. A *score*
model is a cross-encoder (``*ForSequenceClassification``) whose logits score a (query, document) pair.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tokenmill.config.settings import POOLING
from tokenmill.model.dtypes import checkpoint_choice
from tokenmill.model.loading import LoadedModel, ModelLoadError, Stages, pick_device, resolve_checkpoint

log = logging.getLogger(__name__)

POOLING_METHODS = ("cls", "mean", "last")
ST_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}
ACTIVATIONS = {"torch.nn.modules.activation.Tanh": torch.tanh, "torch.nn.modules.linear.Identity": lambda x: x,
               "torch.nn.modules.activation.Sigmoid": torch.sigmoid, "torch.nn.modules.activation.ReLU": torch.relu}


@dataclass(frozen=True)
class Pooling:
    """How hidden states become one vector: ``method`` over the input's tokens, then ``dense`` layers
    (weight, bias, activation), then unit length when ``normalize``."""

    method: str
    normalize: bool
    dense: tuple[tuple[torch.Tensor, torch.Tensor | None, Any], ...] = field(default=(), compare=False)
    source: str = ""
    """Where the choice came from, for the log and /info."""


def task_of(requested: str, model_config: Any) -> str:
    """The task ``--task`` (or ``--runner pooling``) settles on for a checkpoint of ``model_config``."""
    if requested != POOLING:
        return requested
    architectures = getattr(model_config, "architectures", None) or []
    return "score" if any(name.endswith("ForSequenceClassification") for name in architectures) else "embed"


def is_decoder(model_config: Any) -> bool:
    architectures = getattr(model_config, "architectures", None) or []
    if any(name.endswith("ForCausalLM") for name in architectures):
        return True
    return bool(getattr(model_config, "is_decoder", False)) or model_config.model_type in DECODER_TYPES


DECODER_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "gpt2", "gpt_neox",
                 "falcon", "mixtral", "qwen2_moe", "qwen3_moe", "olmo", "olmo2", "granite", "starcoder2")


def read_pooling(path: Path, model_config: Any) -> Pooling:
    """The checkpoint's pooling: its sentence-transformers modules when it has ``modules.json``, else by its kind."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        method = "last" if is_decoder(model_config) else "cls"
        return Pooling(method, normalize=True, source=f"{method} token ({model_config.model_type}, no modules.json)")
    modules = json.loads(modules_file.read_text())
    method, normalize, dense = None, False, []
    for module in sorted(modules, key=lambda entry: int(entry.get("idx", 0))):
        kind, folder = module.get("type", ""), path / module.get("path", "")
        if kind.endswith("models.Pooling"):
            method = st_pooling_method(json.loads((folder / "config.json").read_text()))
        elif kind.endswith("models.Dense"):
            dense.append(dense_layer(folder))
        elif kind.endswith("models.Normalize"):
            normalize = True
        elif not kind.endswith("models.Transformer"):
            raise ModelLoadError(f"modules.json: the sentence-transformers module {kind} is not supported")
    if method is None:
        raise ModelLoadError("modules.json names no Pooling module: the embedding's pooling is unknown")
    return Pooling(method, normalize, tuple(dense), source="modules.json")


def st_pooling_method(settings: dict[str, Any]) -> str:
    """The one pooling mode a sentence-transformers ``1_Pooling/config.json`` turns on."""
    if settings.get("pooling_mode") in POOLING_METHODS:
        return str(settings["pooling_mode"])
    chosen = [method for key, method in ST_MODES.items() if settings.get(key)]
    others = [key for key, value in settings.items()
              if key.startswith("pooling_mode") and value and key not in ST_MODES]
    if len(chosen) != 1 or others:
        raise ModelLoadError(f"1_Pooling/config.json: pooling {sorted(chosen + others)} is not supported "
                             "(one of cls_token, mean_tokens, lasttoken)")
    return chosen[0]


def dense_layer(folder: Path) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
    """A sentence-transformers ``Dense`` module's weight, bias and activation."""
    settings = json.loads((folder / "config.json").read_text())
    if (folder / "model.safetensors").is_file():
        from safetensors.torch import load_file

        weights = load_file(folder / "model.safetensors")
    else:
        weights = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    activation = ACTIVATIONS.get(settings.get("activation_function", "torch.nn.modules.activation.Tanh"))
    if activation is None:
        raise ModelLoadError(f"{folder.name}: the Dense activation {settings['activation_function']} is not supported")
    return weights["linear.weight"].float(), weights.get("linear.bias"), activation


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """One float32 vector per row of right-padded ``hidden`` [batch, positions, width] (``mask``: 1 on real tokens)."""
    hidden = hidden.float()
    if pooling.method == "cls":
        pooled = hidden[:, 0]
    elif pooling.method == "last":
        last = mask.sum(dim=1) - 1
        pooled = hidden[torch.arange(hidden.shape[0]), last]
    else:
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1)
    for weight, bias, activation in pooling.dense:
        pooled = activation(torch.nn.functional.linear(pooled, weight, None if bias is None else bias.float()))
    return pooled


@dataclass
class Batch:
    """Right-padded inputs of one forward."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    token_type_ids: torch.Tensor | None


class PoolingModel:
    """A loaded embedding or score model: a batch of token ids in, one float32 row per input out
    (the pooled vector, or the classifier's logits)."""

    def __init__(self, loaded: LoadedModel, task: str, pooling: Pooling | None) -> None:
        self.loaded = loaded
        self.task = task
        self.pooling = pooling
        config = loaded.model.config
        self.labels: list[str] = [config.id2label[i] for i in range(config.num_labels)] if task == "score" else []
        self.pad_id = loaded.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = loaded.tokenizer.eos_token_id or 0
        self.takes_token_types = "token_type_ids" in loaded.tokenizer.model_input_names
        self.causal = task == "embed" and is_decoder(config)
        """Embeddings of a decoder: run without a padding mask (see :meth:`forward`)."""
        self.matryoshka = tuple(getattr(config, "matryoshka_dimensions", None) or ())
        """The sizes an embedding may be cut to (``dimensions``); any size up to the full one when the
        config says ``is_matryoshka`` without naming sizes."""
        self.any_dimensions = bool(getattr(config, "is_matryoshka", False)) and not self.matryoshka

    @property
    def width(self) -> int:
        """The length of what :meth:`forward` answers per input."""
        if self.task == "score":
            return len(self.labels)
        assert self.pooling is not None
        if self.pooling.dense:
            return int(self.pooling.dense[-1][0].shape[0])
        return int(self.loaded.model.config.hidden_size)

    def batch(self, inputs: list[tuple[list[int], list[int] | None]]) -> Batch:
        """``inputs`` (token ids, token type ids) padded on the right into one batch."""
        longest = max(len(ids) for ids, _ in inputs)
        device = self.loaded.device
        ids = torch.full((len(inputs), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(inputs), longest), dtype=torch.long)
        types = torch.zeros((len(inputs), longest), dtype=torch.long) if self.takes_token_types else None
        for row, (tokens, token_types) in enumerate(inputs):
            ids[row, :len(tokens)] = torch.tensor(tokens)
            mask[row, :len(tokens)] = 1
            if types is not None and token_types is not None:
                types[row, :len(tokens)] = torch.tensor(token_types)
        return Batch(ids.to(device), mask.to(device), None if types is None else types.to(device))

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        kwargs: dict[str, Any] = {"input_ids": batch.input_ids}
        if not self.causal:  # right-padded, a causal model's tokens never see the padding after them: no mask,
            kwargs["attention_mask"] = batch.attention_mask  # so attention takes its causal fast path
        if batch.token_type_ids is not None:
            kwargs["token_type_ids"] = batch.token_type_ids
        output = self.loaded.model(**kwargs)
        if self.task == "score":
            return output.logits.float().cpu()
        assert self.pooling is not None
        return pool(output.last_hidden_state, batch.attention_mask, self.pooling).cpu()


def load_pooling_model(model_id: str | None, revision: str | None, dtype_name: str | None, task: str,
                       trust_remote_code: bool, stages: Stages, hub_cache: str | None = None) -> PoolingModel:
    """Resolve and load the checkpoint for ``task`` (embed, score, or ``pooling`` to choose by its architecture):
    its base model for embeddings, its sequence classifier for scores."""
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification, AutoTokenizer

    display_id, path = resolve_checkpoint(model_id, revision, stages, hub_cache)
    model_config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    task = task_of(task, model_config)
    device = pick_device()
    choice = checkpoint_choice(dtype_name, device, path)
    classes = {"embed": AutoModel, "score": AutoModelForSequenceClassification}

    def load() -> tuple[Any, Any]:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        model = classes[task].from_pretrained(path, dtype=choice.dtype, attn_implementation="sdpa",
                                              trust_remote_code=trust_remote_code)
        return tokenizer, model.to(device).eval()

    try:
        tokenizer, model = stages.run("loading weights", load, detail=f"{path} ({choice.dtype}, {device}, {task})")
    except ValueError as error:  # transformers: no such head for this model type
        raise ModelLoadError(f"--task {task}: {path.name} cannot load as a {classes[task].__name__} "
                             f"({error})") from None
    pooling = read_pooling(path, model_config) if task == "embed" else None
    if pooling is not None:
        log.info("embeddings pooled on the %s token(s), %snormalized (%s)", pooling.method,
                 "" if pooling.normalize else "not ", pooling.source)
    loaded = LoadedModel(model, tokenizer, display_id, path, choice.dtype, device, stages.done, None, choice.reason)
    return PoolingModel(loaded, task, pooling)
