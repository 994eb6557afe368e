"""Plugins: built-ins registered in code, third-party ones through the entry-point group."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tokenmill import hookspecs
from tokenmill.plugins import PluginError, build_plugin_manager, choose, list_all

ROOT = Path(__file__).resolve().parents[1]


def hook_names() -> list[str]:
    return [name for name in dir(hookspecs) if name.startswith("tokenmill_")]


def test_every_hook_is_documented_in_hooks_md():
    documented = set(re.findall(r"^### `(tokenmill_\w+)\(", (ROOT / "hooks.md").read_text(), re.MULTILINE))
    missing = [name for name in hook_names() if name not in documented]
    assert not missing, f"hooks missing from hooks.md: {missing}"
    assert not documented - set(hook_names()), "hooks.md documents hooks that do not exist"


def test_every_hookspec_has_a_docstring_saying_when_what_and_returns():
    for name in hook_names():
        doc = getattr(hookspecs, name).__doc__ or ""
        assert "Called" in doc and "Receives" in doc and "Returns" in doc, name


def test_builtin_implementations_of_each_kind_are_listed():
    rows = {(r.kind, r.name): r for r in list_all(build_plugin_manager(autoload=False))}
    for key in [("backend", "transformers"), ("attention", "sdpa"), ("attention", "eager"),
                ("scheduler", "fifo"), ("scheduler", "priority"), ("kv_allocator", "dynamic"),
                ("quantizer", "int8"), ("quantizer", "int4"), ("quantizer", "gptq"), ("quantizer", "awq")]:
        assert key in rows and rows[key].unavailable_reason is None
        assert rows[key].source.startswith("tokenmill_plugins.")


def test_unknown_name_is_an_error_listing_the_choices():
    with pytest.raises(PluginError, match=r"unknown --backend 'nope' \(choices: auto, flash, paged, transformers\)"):
        choose(build_plugin_manager(autoload=False), "backend", "nope")


THIRD_PARTY = textwrap.dedent('''
    import tokenmill
    from tokenmill.interfaces import AttentionKernel, Scheduler

    class NeedsCuda(AttentionKernel):
        name = "fancy"
        transformers_name = "sdpa"
        description = "a kernel that needs a GPU"

        def unavailable_reason(self):
            return "needs CUDA"

    @tokenmill.hookimpl
    def tokenmill_attention_kernels():
        return [NeedsCuda()]
''')


@pytest.fixture
def third_party_plugin(tmp_path, monkeypatch):
    """A real installed distribution that declares a ``tokenmill`` entry point."""
    (tmp_path / "fancy_attention.py").write_text(THIRD_PARTY)
    dist = tmp_path / "fancy_attention-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fancy-attention\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[tokenmill]\nfancy = fancy_attention\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("TOKENMILL_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    return tmp_path


def test_entry_point_plugins_are_loaded_and_their_unavailability_is_explained(third_party_plugin):
    pm = build_plugin_manager()
    rows = {(r.kind, r.name): r for r in list_all(pm)}
    assert rows[("attention", "fancy")].unavailable_reason == "needs CUDA"
    assert rows[("attention", "fancy")].source == "fancy"
    with pytest.raises(PluginError, match="--attention fancy is not available here: needs CUDA"):
        choose(pm, "attention", "fancy")


def test_autoload_can_be_turned_off(third_party_plugin, monkeypatch):
    monkeypatch.setenv("TOKENMILL_DISABLE_PLUGIN_AUTOLOAD", "1")
    names = {r.name for r in list_all(build_plugin_manager())}
    assert "fancy" not in names and "sdpa" in names


def test_tokenmill_plugins_command_prints_every_implementation(third_party_plugin):
    out = subprocess.run(
        [sys.executable, "-m", "tokenmill", "plugins"], capture_output=True, text=True, check=True,
        env={"PYTHONPATH": str(third_party_plugin), "PATH": "/usr/bin:/bin"},
    ).stdout
    for name in ("transformers", "sdpa", "eager", "fifo", "dynamic"):
        assert re.search(rf"\b{name}\b\s+available", out), out
    assert "fancy" in out and "unavailable: needs CUDA" in out


def test_the_example_scheduler_in_hooks_md_registers_and_schedules_shortest_first():
    import types

    from tokenmill.interfaces import BatchLimits, StepBudget
    from tokenmill.sequence import GenerationRequest, SamplingParams, Sequence

    text = (ROOT / "hooks.md").read_text()
    [code] = [block for block in re.findall(r"```python\n(.*?)```", text, re.DOTALL) if "ShortestFirst" in block]
    module = types.ModuleType("example_scheduler")
    exec(compile(code, "hooks.md", "exec"), module.__dict__)
    pm = build_plugin_manager(autoload=False)
    pm.register(module)
    queue = choose(pm, "scheduler", "shortest-first").create(
        BatchLimits(max_batch_prefill_tokens=30, max_batch_total_tokens=1000, max_batch_size=None))
    seqs = [Sequence(GenerationRequest("", [5] * n, 4, SamplingParams()), lambda event: None, None)
            for n in (20, 3, 9)]
    for seq in seqs:
        queue.add(seq)
    started = queue.admit([], StepBudget(30, chunked=False, kv_free_tokens=None))
    assert [s.prompt_len for s in started] == [3, 9] and len(queue) == 1
