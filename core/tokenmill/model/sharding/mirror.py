"""Keeping the ranks in step: rank 0's runner sends each call that changes its state to the shards
(:class:`MirroredRunner`), and each shard replays them on its own runner (:func:`serve_rank`)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenmill.model.sharding.group import STOP, broadcast, fatal, init_group, leave_group
from tokenmill.model.sharding.plan import load_sharded, plan_slice
from tokenmill.model.sharding.processes import die_with_parent

log = logging.getLogger(__package__)  # the package's logger, as before the split


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
    """A memo a prefix-caching shard runner of its own fills from ``token_ids`` (``tokenmill.engine.prefix``)."""
    images: None = None
    """Never any: vision-language models run on one shard."""
    rotary_positions: None = None
    """Never any, for the same reason (a vision-language model's multimodal rotary positions)."""

    @property
    def pending_len(self) -> int:
        return self.total_len - self.num_computed

    @classmethod
    def of(cls, seq: Any, with_tokens: bool) -> SequenceView:
        return cls(seq.id, seq.num_computed, seq.total_len, seq.last_token, seq.token_ids if with_tokens else [],
                   seq.cache_namespace if with_tokens else "")


POOL_CHANGES = frozenset({"reserve", "free", "free_all", "share", "name", "unname", "truncate", "drop_cached"})
"""The block pool's calls that change it (:class:`tokenmill.interfaces.CachingBlockPool`)."""


class MirroredPool:
    """Rank 0's KV pool as the engine's KV-cache manager changes it: each change is also written down,
    and goes to the shards with the next step, whose pools make the same changes first. The pools are
    alike and the changes the same, so every rank's block tables are too."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.changes: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.inner, name)
        if name not in POOL_CHANGES:
            return value

        def change(*args: Any) -> Any:
            self.changes.append((name, args))
            return value(*args)
        return change

    def take_changes(self) -> list[tuple[str, tuple[Any, ...]]]:
        changes, self.changes = self.changes, []
        return changes


def apply_changes(pool: Any, changes: list[tuple[str, tuple[Any, ...]]]) -> None:
    """Make on a shard's pool the changes rank 0's made."""
    for name, args in changes:
        getattr(pool, name)(*args)


class MirroredRunner:
    """Rank 0's backend runner: every call that changes its state (a step, a release, a reset) is
    first sent to the shards, whose runners of the same backend replay it on their slice of the
    model and their own KV memory, so every rank's cache stays in step. Queries pass through.
    Works for any backend whose runner decides only from these calls (both built-in ones do); a
    runner over a block pool (``kv_pool``) gets its pool's changes with each step instead."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        pool = getattr(inner, "kv_pool", None)
        self.kv_pool = None if pool is None else MirroredPool(pool)
        """A runner over a block pool: the engine changes the pool, and the changes go with each step."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def step(self, prefill: list[Any], chunks: list[int], want_prompt_logits: list[bool], decode: list[Any],
             drafts: list[tuple[int, ...]] | None = None) -> Any:
        changes = self.kv_pool.take_changes() if self.kv_pool is not None else []
        broadcast(("step", changes, [SequenceView.of(s, True) for s in prefill], list(chunks),
                   list(want_prompt_logits), [SequenceView.of(s, False) for s in decode], drafts))
        try:
            out = step(self.inner, (prefill, chunks, want_prompt_logits, decode), drafts)
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

    def rollback(self, seqs: list[Any]) -> None:
        """The shards keep the same drafts as rank 0: its sequences' lengths now say which."""
        broadcast(("rollback", [SequenceView.of(s, False) for s in seqs]))
        self.inner.rollback(seqs)

    def release(self, seqs: list[Any]) -> None:
        broadcast(("release", [SequenceView.of(s, False) for s in seqs]))
        self.inner.release(seqs)

    def reset(self) -> None:
        broadcast(("reset",))
        self.inner.reset()


def step(runner: Any, args: tuple[Any, ...], drafts: list[tuple[int, ...]] | None) -> Any:
    """``runner.step(*args)``, with ``drafts`` only when there are some: a runner that does not speculate
    takes no such argument."""
    return runner.step(*args, drafts=drafts) if drafts else runner.step(*args)


def replay(runner: Any, message: tuple[Any, ...]) -> None:
    """Run on a shard the runner call rank 0 made. An exception ends the shard: after a failure part
    way through a forward, the ranks' collectives would no longer pair up (rank 0's watcher then
    stops the server)."""
    kind = message[0]
    if kind == "step":
        apply_changes(runner.kv_pool, message[1])
        step(runner, message[2:6], message[6])
    elif kind == "release":
        runner.release(message[1])
    elif kind == "rollback":
        runner.rollback(message[1])
    elif kind == "reset":
        runner.reset()
    elif kind == "plan_prefill":
        runner.plan_prefill(*message[1:])
    elif kind == "reset_prefix_cache":
        runner.reset_prefix_cache()


def mirror_runner(runner: Any, setup: dict[str, Any]) -> MirroredRunner:
    """Tell the shards which backend and KV memory to build, then mirror ``runner`` to them."""
    broadcast(setup)
    return MirroredRunner(runner)


def serve_rank(rank: int, world_size: int, config: Any) -> int:
    """A shard's life: join the group, load its slice, build the backend rank 0 describes, then replay
    every runner call rank 0 sends until it says stop (or the group breaks)."""
    from tokenmill.model.dtypes import checkpoint_dtype, choose_dtype
    from tokenmill.model.loading import checkpoint_config, pick_device
    from tokenmill.plugin_manager import build_plugin_manager, choose_all

    die_with_parent()
    device = pick_device()
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
    init_group(rank, world_size, config.master_addr, config.master_port, device)
    path, model_config = checkpoint_config(config.model_id, config.revision)
    shard = plan_slice(model_config, rank, world_size)
    dtype = choose_dtype(config.dtype, device, checkpoint_dtype(path)).dtype
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
