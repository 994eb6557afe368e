"""Tensor parallelism over torch.distributed: ``--num-shard N`` (gloo on CPU, NCCL on CUDA).

Rank 0 runs the server, the scheduler and the engine; ranks 1..N-1 run :func:`run_shard`.
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
"""

from __future__ import annotations

import datetime
import fnmatch
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger(__name__)

STOP = "stop"
"""The message that ends the shards' loop (the server is stopping)."""


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
    """This rank's share of attention heads and MLP columns, or ShardingError with the numbers."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if kv_heads < world_size:
        raise ShardingError(f"the model has {kv_heads} KV heads ({heads} attention heads), fewer than the "
                            f"{world_size} shards asked for: every shard needs at least one; use --num-shard {kv_heads} or fewer")
    if config.intermediate_size < world_size:
        raise ShardingError(f"the MLP has {config.intermediate_size} columns, fewer than {world_size} shards")
    return ShardSlice(rank, world_size, even_split(kv_heads, world_size, rank), heads // kv_heads, head_dim,
                      even_split(config.intermediate_size, world_size, rank))


def init_group(rank: int, world_size: int, master_addr: str, master_port: int, device: torch.device) -> None:
    """Join the process group: NCCL on CUDA, gloo on CPU. Blocks until every rank has joined."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # The ranks share the machine's cores: without this, each would start a thread per core.
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world_size))
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(minutes=30))
    log.info("shard %d of %d joined the %s group at %s:%d", rank, world_size, backend, master_addr, master_port)


def leave_group() -> None:
    """Tear the process group down before the process exits: left to the interpreter's exit, gloo's
    teardown races the other ranks' and sometimes aborts the process ("terminate called ...")."""
    if dist.is_initialized():
        dist.destroy_process_group()


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


# ---- the steps, from rank 0 to the others ------------------------------------------------------


def broadcast(message: Any) -> Any:
    """Rank 0 sends ``message`` (any picklable value) to every rank; the others return it."""
    box = [message if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclass
class SequenceView:
    """What a backend runner reads of a sequence: enough for a shard to replay rank 0's calls.
    Token ids travel only for sequences that prefill; decoding ones need only their last token."""

    id: int
    num_computed: int
    total_len: int
    last_token: int
    token_ids: list[int]
    cache_namespace: str = ""
    block_hashes: list[bytes] = field(default_factory=list)
    """A memo the shard's runner fills from ``token_ids`` (see ``tokenmill.engine.prefix``)."""

    @property
    def pending_len(self) -> int:
        return self.total_len - self.num_computed

    @classmethod
    def of(cls, seq: Any, with_tokens: bool) -> SequenceView:
        return cls(seq.id, seq.num_computed, seq.total_len, seq.last_token, seq.token_ids if with_tokens else [],
                   seq.cache_namespace if with_tokens else "")


def fatal(reason: str) -> None:
    """End rank 0 after a failure the shards cannot be kept in step with: part way through a forward,
    their collectives would no longer pair up with rank 0's. Exit status 3 also stops gunicorn."""
    log.error("%s; the ranks can no longer be kept in step, so the server stops", reason)
    logging.shutdown()
    os._exit(3)


class MirroredRunner:
    """Rank 0's backend runner: every call that changes its state (a step, a release, a reset) is
    first sent to the shards, whose runners of the same backend replay it on their slice of the
    model and their own KV memory, so every rank's cache stays in step. Queries pass through.
    Works for any backend whose runner decides only from these calls (both built-in ones do)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def step(self, prefill: list[Any], chunks: list[int], want_prompt_logits: list[bool], decode: list[Any]) -> Any:
        broadcast(("step", [SequenceView.of(s, True) for s in prefill], list(chunks), list(want_prompt_logits),
                   [SequenceView.of(s, False) for s in decode]))
        try:
            out = self.inner.step(prefill, chunks, want_prompt_logits, decode)
        except BaseException as error:
            fatal(f"a sharded step failed on rank 0 ({type(error).__name__}: {error})")
        if out.prefill_error is not None:
            fatal(f"a sharded prefill failed on rank 0 ({out.prefill_error})")
        return out

    def plan_prefill(self, seq: Any, chunk: int) -> None:
        """Rank 0 plans first: a MemoryError there changes nothing, and the shards are not told."""
        try:
            self.inner.plan_prefill(seq, chunk)
        except MemoryError:
            raise
        except BaseException as error:
            fatal(f"planning a sharded prefill failed on rank 0 ({type(error).__name__}: {error})")
        broadcast(("plan_prefill", SequenceView.of(seq, True), chunk))

    def reset_prefix_cache(self) -> int:
        broadcast(("reset_prefix_cache",))
        return self.inner.reset_prefix_cache()

    def release(self, seqs: list[Any]) -> None:
        broadcast(("release", [SequenceView.of(s, False) for s in seqs]))
        self.inner.release(seqs)

    def reset(self) -> None:
        broadcast(("reset",))
        self.inner.reset()


def replay(runner: Any, message: tuple[Any, ...]) -> None:
    """Run on a shard the runner call rank 0 made. An exception ends the shard: after a failure part
    way through a forward, the ranks' collectives would no longer pair up (rank 0's watcher then
    stops the server)."""
    kind = message[0]
    if kind == "step":
        runner.step(*message[1:])
    elif kind == "release":
        runner.release(message[1])
    elif kind == "reset":
        runner.reset()
    elif kind == "plan_prefill":
        runner.plan_prefill(*message[1:])
    elif kind == "reset_prefix_cache":
        runner.reset_prefix_cache()


def run_shard(rank: int, world_size: int, config: Any) -> int:
    """A shard's life: join the group, load its slice, build the backend rank 0 describes, then replay
    every runner call rank 0 sends until it says stop (or the group breaks)."""
    from tokenmill.model.loading import checkpoint_config, pick_device, pick_dtype
    from tokenmill.plugin_manager import build_plugin_manager, choose_all

    die_with_parent()
    device = pick_device()
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
    init_group(rank, world_size, config.master_addr, config.master_port, device)
    path, model_config = checkpoint_config(config.model_id, config.revision)
    shard = plan_slice(model_config, rank, world_size)
    dtype = pick_dtype(config.dtype, device)
    model = load_sharded(path, shard, model_config, dtype, device, "sdpa")
    setup = broadcast(None)
    if setup["disable_custom_kernels"]:
        from tokenmill.kernels import native as native_kernels

        native_kernels.turn_off("--disable-custom-kernels")
    if setup["prepack_weights"]:
        from tokenmill.model.cpu_linears import pack_linears, packing_unavailable_reason

        if packing_unavailable_reason(model) is None:
            pack_linears(model)
    chosen = choose_all(build_plugin_manager(), setup["backend"], setup["attention"], setup["kv_allocator"], "fifo",
                        setup["block_size"])
    if chosen.attention.transformers_name:  # type: ignore[attr-defined]
        model.set_attn_implementation(chosen.attention.transformers_name)  # type: ignore[attr-defined]
    store = chosen.kv_allocator.create(model.config, setup["kv_dtype"], device,  # type: ignore[attr-defined]
                                       setup["max_tokens"], chosen.block_size)
    runner = chosen.backend.create(model, store, chosen.attention)  # type: ignore[attr-defined]
    if setup.get("prefix_caching"):
        runner.enable_prefix_caching()
    log.info("shard %d ready: heads %s, MLP columns %s, %s backend", rank, shard.heads, shard.intermediate,
             chosen.backend.name)
    while True:
        message = broadcast(None)
        if message == STOP:
            leave_group()
            return 0
        try:
            replay(runner, message)
        except Exception:  # noqa: BLE001 - logged whole, then the shard ends
            log.exception("shard %d: replaying rank 0's %s failed; the shard stops", rank, message[0])
            logging.shutdown()
            # Not a normal exit: tearing the group down would wait for rank 0, which waits in a
            # collective for this shard. Ending now lets rank 0's watcher see it and stop the server.
            os._exit(1)


def shard_environment(rank: int, world_size: int, master_addr: str, master_port: int) -> dict[str, str]:
    return {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "TOKENMILL_RANK0_PID": str(os.getpid())}


def load_rank0_model(config: Any, stages: Any, attn_implementation: str) -> Any:
    """Rank 0's share of the model, as a LoadedModel: joins the group first (the shards wait for it)."""
    from transformers import AutoTokenizer

    from tokenmill.model.loading import DEFAULT_MODEL_NAME, LoadedModel, checkpoint_config, pick_device, pick_dtype

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
    dtype = pick_dtype(config.dtype, device)

    def load() -> tuple[Any, nn.Module]:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=config.trust_remote_code)
        return tokenizer, load_sharded(path, shard, model_config, dtype, device, attn_implementation)

    tokenizer, model = stages.run("loading weights", load,
                                  detail=f"{path} ({dtype}, {device}), shard 0 of {world_size}: heads {shard.heads}")
    return LoadedModel(model, tokenizer, config.model_id or DEFAULT_MODEL_NAME, path, dtype, device, stages.done)


def mirror_runner(runner: Any, setup: dict[str, Any]) -> MirroredRunner:
    """Tell the shards which backend and KV memory to build, then mirror ``runner`` to them."""
    broadcast(setup)
    return MirroredRunner(runner)


class ShardProcesses:
    """Ranks 1..N-1 started by rank 0 as child processes, watched, and never left behind."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.processes: list[Any] = []

    def start(self) -> None:
        import subprocess
        import sys

        config = self.config
        args = ["--num-shard", str(config.num_shard), "--master-addr", config.master_addr,
                "--master-port", str(config.master_port)]
        for flag, value in (("--model-id", config.model_id), ("--revision", config.revision), ("--dtype", config.dtype)):
            if value:
                args += [flag, value]
        if config.trust_remote_code:
            args.append("--trust-remote-code")
        for rank in range(1, config.num_shard):
            env = shard_environment(rank, config.num_shard, config.master_addr, config.master_port)
            self.processes.append(subprocess.Popen([sys.executable, "-m", "tokenmill", "launch", *args], env=env))
        log.info("started %d shard processes (pids %s)", len(self.processes), [p.pid for p in self.processes])

    def first_exit(self) -> tuple[int, int] | None:
        """(rank, exit code) of a shard that has ended, or None while all run."""
        for rank, process in enumerate(self.processes, start=1):
            code = process.poll()
            if code is not None:
                return rank, code
        return None

    def stop(self, timeout: float = 10.0) -> None:
        import subprocess

        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()


def die_with_parent() -> None:
    """A shard started by rank 0 asks Linux to end it when rank 0's process ends, however that ends
    (and ends now if that already happened)."""
    import ctypes
    import signal

    parent = os.environ.get("TOKENMILL_RANK0_PID")
    if parent is None:  # started by torchrun, which watches its ranks itself
        return
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != int(parent):
        os._exit(1)
