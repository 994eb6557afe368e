"""``tokenmill launch``: check the settings (:func:`preflight`), then serve on rank 0; under torchrun,
ranks 1..N-1 serve only their slice of the model (:func:`launch_rank`)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import replace

import torch

from tokenmill.config import Config, ConfigError, parse_config
from tokenmill.model import collector
from tokenmill.model.loading import ModelLoadError, check_source, checkpoint_config
from tokenmill.model.sharding import ShardingError
from tokenmill.observability.logs import setup_logging
from tokenmill.observability.tracing import TracingUnavailable
from tokenmill.plugin_manager import PluginError, build_plugin_manager, choose, choose_all

PREFLIGHT_ERRORS = (ConfigError, PluginError, ModelLoadError, ShardingError, TracingUnavailable)
"""What :func:`preflight` raises: each a one-line reason not to start."""


def preflight(config: Config) -> None:
    """Fail before serving on what can be known without loading: plugin choices, model path."""
    # This process may fork the server afterwards (gunicorn): ask NVML, not the CUDA runtime,
    # whether there are GPUs, so that CUDA is not initialised before the fork.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    pm = build_plugin_manager()
    chosen = choose_all(pm, config.backend, config.attention, config.kv_allocator, config.scheduler, config.block_size)
    if config.quantize:
        choose(pm, "quantizer", config.quantize)
    if config.tool_call_parser:
        choose(pm, "tool_parser", config.tool_call_parser)
    if config.reasoning_parser:
        choose(pm, "reasoning_parser", config.reasoning_parser)
    if config.num_shard > 1:
        from tokenmill.model.sharding import plan_slice

        _, model_config = checkpoint_config(config.model_id, config.revision)
        plan_slice(model_config, 0, config.num_shard)
        method = (getattr(model_config, "quantization_config", None) or {}).get("quant_method")
        if method:
            raise ConfigError(f"the checkpoint is quantized with {method}, and quantized models cannot shard yet: "
                              "run it with --num-shard 1")
        if (torch.cuda.is_available() and "LOCAL_RANK" not in os.environ
                and torch.cuda.device_count() < config.num_shard):
            raise ConfigError(f"--num-shard {config.num_shard} needs a GPU per shard; this machine has "
                              f"{torch.cuda.device_count()}")
    from tokenmill.engine.startup import settings_unavailable_reason

    unavailable = settings_unavailable_reason(config, chosen, "cuda" if torch.cuda.is_available() else "cpu")
    if unavailable:
        raise ConfigError(unavailable)
    if config.otlp_endpoint:
        from tokenmill.observability.tracing import require_packages

        require_packages()
    if config.serves_several():
        from tokenmill.http.router.catalog import served_models

        if torch.cuda.is_available():
            raise ConfigError("several models in one process (--models-dir, --model-id repeated) run on CPU only: "
                              "each model's KV pool would size itself to the whole GPU")
        for model_id in served_models(config).values():
            check_source(model_id, config.revision, config.huggingface_hub_cache)
        return
    check_source(config.model_id, config.revision, getattr(config, "huggingface_hub_cache", None))


def launch_rank(rank: int, config: Config) -> int:
    """Ranks 1..N-1: no server, only their slice of the model and the forward rank 0 asks for."""
    from tokenmill.model import sharding

    try:
        return sharding.serve_rank(rank, config.num_shard, config)
    except (ShardingError, ModelLoadError) as error:
        print(f"tokenmill: shard {rank}: error: {error}", file=sys.stderr)
        return 2


def launch(argv: Sequence[str]) -> int:
    try:
        config = parse_config(argv)
    except ConfigError as error:
        print(f"tokenmill: error: {error}", file=sys.stderr)
        return 2
    setup_logging(config.json_output)
    rank = int(os.environ.get("RANK", "0"))
    if "WORLD_SIZE" in os.environ:  # started by torchrun (or by rank 0): the group's size wins
        config = replace(config, num_shard=int(os.environ["WORLD_SIZE"]))
        try:
            config.check()
        except ConfigError as error:
            print(f"tokenmill: error: {error}", file=sys.stderr)
            return 2
    if rank > 0 or config.serves_several():
        collector.release_full_collections()  # only a server of one model ends its start (freeze_start_heap)
    if rank > 0:
        return launch_rank(rank, config)
    try:
        preflight(config)
    except PREFLIGHT_ERRORS as error:
        print(f"tokenmill: error: {error}", file=sys.stderr)
        return 2
    from tokenmill.http.serve import serve

    return serve(config)
