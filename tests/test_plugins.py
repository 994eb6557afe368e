"""Plugins: built-ins registered in code, third-party ones through the entry-point group."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from doc_blocks import fenced_blocks

from tokenmill import hookspecs
from tokenmill.plugin_manager import PluginError, build_plugin_manager, choose, list_all

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

    from tokenmill.engine.scheduling import Admission
    from tokenmill.engine.sequence import GenerationRequest, SamplingParams, Sequence
    from tokenmill.interfaces import BatchLimits, StepBudget

    [code] = [block.text for block in fenced_blocks(ROOT / "hooks.md")
              if block.language == "python" and "ShortestFirst" in block.text]
    assert len([line for line in code.splitlines() if line.strip()]) <= 30  # a whole third-party policy, at a glance
    module = types.ModuleType("example_scheduler")
    exec(compile(code, "hooks.md", "exec"), module.__dict__)
    pm = build_plugin_manager(autoload=False)
    pm.register(module)
    queue = choose(pm, "scheduler", "shortest-first").create(
        BatchLimits(max_batch_prefill_tokens=30, max_batch_total_tokens=1000, max_batch_size=None))
    admission = Admission.of(queue)
    assert type(admission) is Admission  # a hooks 2.0 policy: the engine admits in its order
    seqs = [Sequence(GenerationRequest("", [5] * n, 4, SamplingParams()), lambda event: None, None)
            for n in (20, 3, 9)]
    for seq in seqs:
        queue.add(seq)
    started = admission.admit([], StepBudget(30, chunked=False, kv_free_tokens=None))
    assert [s.prompt_len for s in started] == [3, 9] and len(queue) == 1
    assert admission.pending() == [seqs[0]]


# ---- third-party plugins that misbehave ------------------------------------------------------------


def install_fake(site: Path, entry_point: str, module: str, code: str) -> None:
    """A distribution ``<module>-plugin`` in ``site`` whose ``tokenmill`` entry point ``entry_point``
    is the module ``module`` with ``code``."""
    (site / f"{module}.py").write_text(textwrap.dedent(code))
    dist = site / f"{module}_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[tokenmill]\n{entry_point} = {module}\n")


SPF = '''
    import tokenmill
    from tokenmill.interfaces import Scheduler

    tokenmill_hooks_version = "1.0"

    class Quick(Scheduler):
        name = "quick"
        description = "a scheduler from a plugin"

    @tokenmill.hookimpl
    def tokenmill_schedulers():
        return [Quick()]
'''


@pytest.fixture
def misbehaving_plugins(tmp_path, monkeypatch):
    install_fake(tmp_path, "good", "good_plugin", SPF)
    install_fake(tmp_path, "broken", "broken_import", "import no_such_module_anywhere\n")
    install_fake(tmp_path, "future", "future_plugin", 'tokenmill_hooks_version = "3.0"\n')
    install_fake(tmp_path, "stranger", "stranger_plugin", '''
        import tokenmill

        @tokenmill.hookimpl
        def tokenmill_frobnicate():
            return None
    ''')
    install_fake(tmp_path, "raiser", "raising_plugin", '''
        import tokenmill

        @tokenmill.hookimpl
        def tokenmill_schedulers():
            raise RuntimeError("scheduler table corrupt")

        @tokenmill.hookimpl
        def tokenmill_load_stage(stage, seconds, detail):
            raise ValueError("observer fell over")
    ''')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("TOKENMILL_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.delenv("TOKENMILL_PLUGINS", raising=False)
    return tmp_path


def test_broken_plugins_are_left_out_with_one_line_each_and_the_rest_keep_working(misbehaving_plugins, caplog):
    pm = build_plugin_manager()
    assert "failed to import: ModuleNotFoundError" in pm.problems["broken"]
    assert pm.problems["future"] == "it was built for tokenmill hooks 3.0; this tokenmill has hooks 2.1"
    assert "implements tokenmill_frobnicate" in pm.problems["stranger"]
    assert choose(pm, "scheduler", "quick").name == "quick"  # a good plugin (for hooks 1.0) beside them loads
    assert choose(pm, "scheduler", "fifo").name == "fifo"  # and so do the built-ins
    left_out = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(left_out) == 3
    assert any(m.startswith("plugin broken (broken_import-plugin 1.0) left out") for m in left_out)


def test_a_hook_that_raises_is_named_and_skipped_and_fails_only_a_choice_of_its_own(misbehaving_plugins, caplog):
    pm = build_plugin_manager()
    pm.hook.tokenmill_load_stage(stage="warm-up", seconds=0.1, detail="")  # does not raise
    assert any("plugin raiser (raising_plugin-plugin 1.0): hook tokenmill_load_stage raised ValueError"
               in r.getMessage() for r in caplog.records)
    assert choose(pm, "scheduler", "fifo").name == "fifo"
    with pytest.raises(PluginError, match="hook tokenmill_schedulers raised RuntimeError: scheduler table corrupt"):
        choose(pm, "scheduler", "its-own")


def test_an_allow_list_loads_only_the_named_plugins(misbehaving_plugins, monkeypatch):
    monkeypatch.setenv("TOKENMILL_PLUGINS", "good")
    pm = build_plugin_manager()
    assert pm.problems == {} and pm.get_plugin("good") is not None and pm.get_plugin("raiser") is None


def test_tokenmill_plugins_shows_the_broken_ones(misbehaving_plugins):
    out = subprocess.run([sys.executable, "-m", "tokenmill", "plugins"], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(misbehaving_plugins), "PATH": "/usr/bin:/bin"}).stdout
    assert re.search(r"plugin\s+future\s+broken: it was built for tokenmill hooks 3.0", out), out
    assert re.search(r"\bquick\b\s+available", out)
