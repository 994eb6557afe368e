"""Plugin authors are not broken by the move into subpackages: every import path that hooks.md
named before keeps working, and gives the very module or object that lives at the new path."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import tokenmill


@pytest.mark.parametrize("old, new", sorted(tokenmill.MOVED_MODULES.items()))
def test_an_old_module_path_is_the_moved_module_itself(old: str, new: str) -> None:
    assert importlib.import_module(old) is importlib.import_module(new)


OLD_IMPORTS = [
    "from tokenmill.interfaces import Backend, BackendRunner, Scheduler, SchedulerQueue, StepBudget, PagedStep",
    "from tokenmill.admission import Room, joins_now",
    "from tokenmill.engine import Engine",
    "from tokenmill.quant_linears import Int4Linear, linear_layers, replace_module",
    "from tokenmill.sequence import GenerationRequest, SamplingParams, Sequence, TokenEvent",
    "from tokenmill.sampling import SequenceSampler, uses_sampling",
    "from tokenmill.prefix import block_hash, full_block_hashes",
    "from tokenmill.kv_memory import bytes_per_token, model_kv_shape",
    "from tokenmill.loading import ModelLoadError",
    "from tokenmill.lora import Adapter, AdapterCache, adapter_rows",
    "from tokenmill.server import ServerState, create_app",
    "from tokenmill.plugins import build_plugin_manager, choose",
    "from tokenmill.hookspecs import HOOKS_VERSION",
    "import tokenmill.native_kernels, tokenmill.startup; tokenmill.startup.start_engine",
]
CHECK = """
import sys
failed = []
for statement in sys.argv[1:]:
    try:
        exec(statement, {})
    except Exception as error:
        failed.append(f"{statement}: {type(error).__name__}: {error}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_the_import_paths_plugins_were_written_against_still_work() -> None:
    # In a fresh interpreter, so that nothing imported earlier by the tests makes it pass.
    result = subprocess.run([sys.executable, "-c", CHECK, *OLD_IMPORTS], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_hooks_stay_at_version_1() -> None:
    from tokenmill.hookspecs import HOOKS_VERSION

    assert HOOKS_VERSION.split(".")[0] == "1"


def test_an_old_module_is_reachable_as_an_attribute_of_the_package() -> None:
    assert tokenmill.startup is importlib.import_module("tokenmill.engine.startup")
    with pytest.raises(AttributeError):
        _ = tokenmill.no_such_module


def test_a_backend_written_for_hooks_1_0_still_says_why_it_cannot_run_a_model() -> None:
    from tokenmill.interfaces import Backend

    class OldBackend(Backend):
        name = "old"

        def model_unsupported_reason(self, model: object) -> str | None:  # the 1.0 name
            return "written for another architecture"

    assert OldBackend().model_unavailable_reason(object()) == "written for another architecture"


def test_a_submodule_reached_through_an_old_path_is_the_moved_one_not_a_copy() -> None:
    moved = importlib.import_module("tokenmill.model.sharding.plan")
    assert importlib.import_module("tokenmill.sharding.plan") is moved
