"""What the in-process benchmarks share: the prompt set, and the engine as ``tokenmill launch``
builds it (same plugins, KV sizing and warm-up) with end-of-sequence ignored."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

PROMPT_SET = Path(__file__).resolve().parent / "prompts" / "v1.json"


def prompt_set(path: Path = PROMPT_SET) -> dict[str, Any]:
    """The versioned prompt set: ``version``, ``description`` and ``prompts`` (id, kind, messages)."""
    return json.loads(path.read_text())


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` through the model's chat template, ready for the assistant's turn."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def start_ignoring_eos(config: Any) -> Any:
    """``tokenmill.engine.startup.Started`` for ``config``; every request then runs to its ``max_new_tokens``."""
    from tokenmill.engine.startup import start_engine
    from tokenmill.model.loading import Stages
    from tokenmill.plugin_manager import build_plugin_manager

    # The compile in the warm-up: measured steps run the compiled forward from the first.
    started = start_engine(dataclasses.replace(config, compile_before_ready=True), build_plugin_manager(), Stages())
    started.engine.output.eos_ids = set()
    return started
