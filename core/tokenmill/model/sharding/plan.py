"""How the model is split: each rank's slice of heads and MLP columns, the parallel linears that
hold it, and loading only that slice from the checkpoint (rank 0's too, once the group is joined)."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tokenmill.model.sharding.group import init_group
from tokenmill.model.vision import takes_images


class ShardingError(ValueError):
    """The model cannot be split over this many shards; the message gives the numbers."""


@dataclass(frozen=True)
class ShardSlice:
    """Which part of the model one rank holds."""

    rank: int
    world_size: int
    kv_heads: tuple[int, int]
    """[first, last) KV heads of this rank; its query heads are their groups."""
    heads_per_kv: int
    head_dim: int
    intermediate: tuple[int, int]

    @property
    def heads(self) -> tuple[int, int]:
        return self.kv_heads[0] * self.heads_per_kv, self.kv_heads[1] * self.heads_per_kv


def even_split(total: int, parts: int, index: int) -> tuple[int, int]:
    """[first, last) of part ``index`` when ``total`` is split as evenly as possible (larger parts first)."""
    base, extra = divmod(total, parts)
    first = index * base + min(index, extra)
    return first, first + base + (1 if index < extra else 0)


def plan_slice(config: Any, rank: int, world_size: int) -> ShardSlice:
    """This rank's share of attention heads and MLP columns, or ShardingError with the numbers (or why
    the model cannot be sharded at all)."""
    if takes_images(config):
        raise ShardingError(f"{type(config).__name__} is a vision-language model: it runs on one shard (the shards "
                            "would split its language model, not its vision encoder); use --num-shard 1")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if kv_heads < world_size:
        raise ShardingError(f"the model has {kv_heads} KV heads ({heads} attention heads), fewer than the "
                            f"{world_size} shards asked for: every shard needs at least one; "
                            f"use --num-shard {kv_heads} or fewer")
    if config.intermediate_size < world_size:
        raise ShardingError(f"the MLP has {config.intermediate_size} columns, fewer than {world_size} shards")
    return ShardSlice(rank, world_size, even_split(kv_heads, world_size, rank), heads // kv_heads, head_dim,
                      even_split(config.intermediate_size, world_size, rank))


def column_parallel_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """A rank's output rows of a linear layer: a plain ``nn.Linear`` of its slice, no communication
    (and so packed for oneDNN on CPU like any other)."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias, requires_grad=False)
    return layer


class RowParallelLinear(nn.Module):
    """A rank's input columns of a linear layer: its partial sums, added up over the ranks (all-reduce),
    then the bias once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.partial = column_parallel_linear(weight, None)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.partial(x)
        dist.all_reduce(out)
        return out if self.bias is None else out + self.bias


ATTENTION_HEADS = ("q_proj", "o_proj")
KV_HEADS = ("k_proj", "v_proj")
MLP_COLUMNS = ("gate_proj", "up_proj", "down_proj")
"""The layer names whose slices tokenmill knows (Llama, Mistral, Qwen and their kin); others are refused."""


def tp_plan(config: Any, prefix: str) -> dict[str, str]:
    """The config's tensor-parallel plan, as module patterns under the model's ``prefix``."""
    plan = getattr(config, "base_model_tp_plan", None) or {}
    if not plan:
        raise ShardingError(f"{type(config).__name__} has no tensor-parallel plan (base_model_tp_plan): "
                            "tokenmill does not know how to split it")
    return {f"{prefix}.{pattern}": style for pattern, style in plan.items()}


def _span(shard: ShardSlice, name: str) -> tuple[int, int]:
    """[first, last) rows (column-parallel) or columns (row-parallel) of this rank's slice of ``name``."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ATTENTION_HEADS:
        first, last = shard.heads
        return first * shard.head_dim, last * shard.head_dim
    if leaf in KV_HEADS:
        return shard.kv_heads[0] * shard.head_dim, shard.kv_heads[1] * shard.head_dim
    if leaf in MLP_COLUMNS:
        return shard.intermediate
    raise ShardingError(f"the tensor-parallel plan splits {name}, a layer tokenmill does not know how to slice "
                        f"(it knows {', '.join(ATTENTION_HEADS + KV_HEADS + MLP_COLUMNS)})")


def load_sharded(path: Path, shard: ShardSlice, config: Any, dtype: torch.dtype, device: torch.device,
                 attn_implementation: str) -> nn.Module:
    """The model with this rank's slices only, read from the checkpoint's safetensors files."""
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    plan = tp_plan(config, model.base_model_prefix)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ShardingError(f"{path} holds no .safetensors weights to shard")
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    where = {key: handle for handle in handles for key in handle.keys()}

    def read(key: str, rows: tuple[int, int] | None = None, columns: tuple[int, int] | None = None) -> torch.Tensor:
        if key not in where:
            raise ShardingError(f"the checkpoint has no tensor {key!r}")
        view = where[key].get_slice(key)
        tensor = view[rows[0]:rows[1]] if rows else view[:, columns[0]:columns[1]] if columns else view[:]
        return tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)

    sharded = set()
    for name, module in list(model.named_modules()):
        style = next((s for pattern, s in plan.items() if fnmatch.fnmatch(name, pattern)), None)
        if style is None or not isinstance(module, nn.Linear):
            continue
        span = _span(shard, name)
        bias_key = f"{name}.bias"
        if style == "colwise":
            bias = read(bias_key, rows=span) if module.bias is not None else None
            layer: nn.Module = column_parallel_linear(read(f"{name}.weight", rows=span), bias)
        elif style == "rowwise":
            bias = read(bias_key) if module.bias is not None else None
            layer = RowParallelLinear(read(f"{name}.weight", columns=span), bias)
        else:
            raise ShardingError(f"tensor-parallel style {style!r} of {name} is not supported")
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
        sharded.update({f"{name}.weight", bias_key})
    if not sharded:
        raise ShardingError(f"no layer of {type(model).__name__} matched its tensor-parallel plan")
    state = {key: read(key) for key in where if key not in sharded}
    _, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    left = [key for key, tensor in model.named_parameters() if tensor.is_meta]
    if left or unexpected:
        raise ShardingError(f"the checkpoint does not fit the model: missing {left[:3]}, unexpected {unexpected[:3]}")
    local = config.__class__.from_dict(config.to_dict())  # this rank's heads, for its KV pool
    local.head_dim = shard.head_dim
    local.num_attention_heads = shard.heads[1] - shard.heads[0]
    local.num_key_value_heads = shard.kv_heads[1] - shard.kv_heads[0]
    model.config = local
    return model.to(device).eval()


def load_rank0_model(config: Any, stages: Any, attn_implementation: str) -> Any:
    """Rank 0's share of the model, as a LoadedModel: joins the group first (the shards wait for it)."""
    from transformers import AutoTokenizer

    from tokenmill.model.dtypes import checkpoint_choice
    from tokenmill.model.loading import DEFAULT_MODEL_NAME, LoadedModel, checkpoint_config, pick_device

    device = pick_device()
    if device.type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    world_size = config.num_shard
    stages.run("joining shards", lambda: init_group(0, world_size, config.master_addr, config.master_port, device),
               detail=f"{world_size} shards at {config.master_addr}:{config.master_port}")
    path, model_config = stages.run("resolving", lambda: checkpoint_config(config.model_id, config.revision),
                                    detail=str(config.model_id or "default"))
    shard = plan_slice(model_config, 0, world_size)
    choice = checkpoint_choice(config.dtype, device, path)
    dtype = choice.dtype

    def load() -> tuple[Any, nn.Module]:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=config.trust_remote_code)
        return tokenizer, load_sharded(path, shard, model_config, dtype, device, attn_implementation)

    tokenizer, model = stages.run("loading weights", load,
                                  detail=f"{path} ({dtype}, {device}), shard 0 of {world_size}: heads {shard.heads}")
    return LoadedModel(model, tokenizer, config.model_id or DEFAULT_MODEL_NAME, path, dtype, device, stages.done,
                       dtype_reason=choice.reason)
