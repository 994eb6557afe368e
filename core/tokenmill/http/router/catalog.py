"""Which models a several-model server serves, by name, and each one's settings.

The models are those ``--model-id`` names (each named by its id) and the checkpoints under ``--models-dir``: a
subdirectory holding a ``config.json`` (named by the subdirectory) or a ``.gguf`` file (named by its stem). The
first is the default, for requests that name none.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

from tokenmill.config import Config, ConfigError
from tokenmill.config.settings import POOLING

log = logging.getLogger(__name__)

GENERATIVE_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")
"""Architectures that generate text; a checkpoint with none of them is served as vLLM's ``--runner pooling``."""


def served_models(config: Config) -> dict[str, str]:
    """Each model's name → its ``--model-id`` (a hub id, a directory or a .gguf file), the default first."""
    found: dict[str, str] = {}
    for model_id in (config.model_id, *config.more_model_ids):
        if model_id:
            _add(found, model_id.rstrip("/"), model_id)
    if config.models_dir:
        for path in sorted(Path(config.models_dir).iterdir()):
            if path.is_dir() and (path / "config.json").is_file():
                _add(found, path.name, str(path))
            elif path.is_file() and path.suffix == ".gguf":
                _add(found, path.stem, str(path))
    if not found:
        raise ConfigError(f"--models-dir {config.models_dir} holds no checkpoint (a subdirectory with a config.json, "
                          "or a .gguf file)")
    return found


def _add(found: dict[str, str], name: str, model_id: str) -> None:
    if name in found and found[name] != model_id:
        log.warning("two models are named %s (%s and %s): the first is served", name, found[name], model_id)
        return
    found[name] = model_id


def model_config(config: Config, name: str, model_id: str) -> Config:
    """The settings one model is served with: the server's, its own id and name, a K-th of the KV memory, its
    task from its architecture, every request that arrives while it loads held for it, and the eager forward:
    torch.compile's caches belong to the process and keep an unloaded model's compiled weights (measured: each
    unload of SmolLM2 kept 280 MiB)."""
    pooling = config.task == "generate" and pooling_checkpoint(model_id)
    return replace(
        config, model_id=model_id, served_model_name=name, models_dir=None, more_model_ids=(),
        runner=POOLING if pooling else config.runner,
        max_client_batch_size=None if pooling else config.max_client_batch_size,  # the pooling default then
        kv_memory_fraction=config.kv_memory_fraction / config.max_loaded_models,
        hold_while_loading=max(config.hold_while_loading, config.max_concurrent_requests),
        compile_model=False, compile_before_ready=False, prometheus_port=None, notices=())


def pooling_checkpoint(model_id: str) -> bool:
    """A local checkpoint whose architectures all embed or classify (a hub id or a .gguf file generates)."""
    path = Path(model_id) / "config.json"
    if not path.is_file():
        return False
    try:
        architectures = json.loads(path.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return False
    return bool(architectures) and not any(name.endswith(GENERATIVE_SUFFIXES) for name in architectures)
