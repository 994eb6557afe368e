"""Tensor parallelism over torch.distributed: ``--num-shard N`` (gloo on CPU, NCCL on CUDA).

Rank 0 runs the server, the scheduler and the engine; ranks 1..N-1 run :func:`serve_rank`.
Every step rank 0 broadcasts the backend call it is about to make (which sequences
prefill which tokens, which decode, which leave); every rank makes it on its slice of the
model and its own KV memory, the row-parallel layers adding up their partial sums, and
rank 0 samples. Both backends shard this way, since their runners decide only from those
calls.

The slicing follows the model config's own tensor-parallel plan
(``base_model_tp_plan``: q/k/v/gate/up ``colwise``, o/down ``rowwise``), with tokenmill's
layers rather than transformers' DTensor ones: these load only their slice from
safetensors, and they split attention by whole KV-head groups, so a model whose KV
heads do not divide evenly (SmolLM2: 3 over 2 shards) still shards, one rank taking a
group more. Embeddings, norms and the LM head are replicated.

The modules: :mod:`~tokenmill.model.sharding.plan` (each rank's slice, the parallel linears, loading
a slice), :mod:`~tokenmill.model.sharding.group` (the process group and its broadcasts),
:mod:`~tokenmill.model.sharding.mirror` (rank 0's mirrored runner, the shards' replay loop) and
:mod:`~tokenmill.model.sharding.processes` (the shard processes rank 0 starts); every name is
importable from here.
"""

from tokenmill.model.sharding.group import STOP, broadcast, fatal, init_group, leave_group
from tokenmill.model.sharding.mirror import MirroredRunner, SequenceView, mirror_runner, replay, serve_rank
from tokenmill.model.sharding.plan import (
    ATTENTION_HEADS,
    KV_HEADS,
    MLP_COLUMNS,
    RowParallelLinear,
    ShardingError,
    ShardSlice,
    column_parallel_linear,
    even_split,
    load_rank0_model,
    load_sharded,
    plan_slice,
    tp_plan,
)
from tokenmill.model.sharding.processes import ShardProcesses, die_with_parent, shard_environment

__all__ = [
    "ATTENTION_HEADS",
    "KV_HEADS",
    "MLP_COLUMNS",
    "STOP",
    "MirroredRunner",
    "RowParallelLinear",
    "SequenceView",
    "ShardProcesses",
    "ShardSlice",
    "ShardingError",
    "broadcast",
    "column_parallel_linear",
    "die_with_parent",
    "even_split",
    "fatal",
    "init_group",
    "leave_group",
    "load_rank0_model",
    "load_sharded",
    "mirror_runner",
    "plan_slice",
    "replay",
    "serve_rank",
    "shard_environment",
    "tp_plan",
]
