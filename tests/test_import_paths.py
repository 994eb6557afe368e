"""Plugin authors are not broken by the move into subpackages: every old import path that hooks.md (hooks 1.0)
promised still imports, says on import that it is deprecated, and gives the very objects of the new path."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

OLD_PATHS = {  # hooks.md's table: old path -> new path(s), and the names plugins use from it
    "tokenmill.admission": (("tokenmill.engine.admission",), ("Room", "joins_now")),
    "tokenmill.prefix": (("tokenmill.engine.prefix",), ("block_hash", "full_block_hashes", "BlockChain")),
    "tokenmill.quant_linears": (("tokenmill.model.quant_linears",), ("Int4Linear", "linear_layers", "replace_module")),
    "tokenmill.sequence": (("tokenmill.engine.sequence",), ("GenerationRequest", "SamplingParams", "Sequence",
                                                            "TokenEvent")),
    "tokenmill.server": (("tokenmill.http.app", "tokenmill.http.state"), ("ServerState", "create_app")),
    "tokenmill.lora": (("tokenmill.model.adapters",), ("Adapter", "AdapterCache", "adapter_rows")),
    "tokenmill.kv_memory": (("tokenmill.model.kv_memory",), ("bytes_per_token", "model_kv_shape")),
    "tokenmill.plugins": (("tokenmill.plugin_manager",), ("build_plugin_manager", "choose")),
}


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_an_old_path_gives_the_new_modules_objects_and_warns_that_it_is_deprecated(old: str) -> None:
    new_paths, names = OLD_PATHS[old]
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert any(issubclass(w.category, DeprecationWarning) and new_paths[0] in str(w.message) for w in caught)
    new_modules = [importlib.import_module(path) for path in new_paths]
    for name in names:
        assert any(getattr(module, name) is getattr(new, name, None) for new in new_modules), name


def test_the_old_paths_import_in_a_fresh_interpreter() -> None:
    # In a fresh interpreter, so that nothing imported earlier by the tests makes it pass.
    statements = [f"from {old} import {', '.join(names)}" for old, (_, names) in OLD_PATHS.items()]
    statements += [("from tokenmill.interfaces import Backend, BackendRunner, Scheduler, SchedulerQueue, StepBudget, "
                    "PagedStep"),
                   "from tokenmill.engine import Engine",
                   "from tokenmill.sampling import SequenceSampler, uses_sampling",
                   "from tokenmill.hookspecs import HOOKS_VERSION"]
    result = subprocess.run([sys.executable, "-c", "\n".join(statements)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_only_the_promised_old_paths_are_kept() -> None:
    for gone in ("tokenmill.startup", "tokenmill.native_kernels", "tokenmill.loading", "tokenmill.sharding"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(gone)


def test_the_hooks_are_at_version_2_and_plugins_for_hooks_1_still_load() -> None:
    from tokenmill.hookspecs import HOOKS_VERSION
    from tokenmill.plugin_manager import version_unavailable_reason

    assert HOOKS_VERSION.split(".")[0] == "2"
    for built_for in ("1.0", "2.0"):
        assert version_unavailable_reason(type("Plugin", (), {"tokenmill_hooks_version": built_for})) is None
    assert version_unavailable_reason(type("Plugin", (), {"tokenmill_hooks_version": "2.9"})) is not None


def test_a_backend_written_for_hooks_1_0_still_says_why_it_cannot_run_a_model() -> None:
    from tokenmill.interfaces import Backend

    class OldBackend(Backend):
        name = "old"

        def model_unsupported_reason(self, model: object) -> str | None:  # the 1.0 name
            return "written for another architecture"

    assert OldBackend().model_unavailable_reason(object()) == "written for another architecture"
