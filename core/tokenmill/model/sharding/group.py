"""The process group the ranks share, and the messages rank 0 broadcasts over it."""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__package__)  # the package's logger, as before the split


STOP = "stop"
"""The message that ends the shards' loop (the server is stopping)."""


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


def broadcast(message: Any) -> Any:
    """Rank 0 sends ``message`` (any picklable value) to every rank; the others return it."""
    box = [message if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def fatal(reason: str) -> None:
    """End rank 0 after a failure the shards cannot be kept in step with: part way through a forward,
    their collectives would no longer pair up with rank 0's. Exit status 3 also stops gunicorn."""
    log.error("%s; the ranks can no longer be kept in step, so the server stops", reason)
    logging.shutdown()
    os._exit(3)
