"""hooks.md's hook reference is generated from core/tokenmill/hookspecs.py, and the docstrings say enough."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
from conftest import ci_script

from tokenmill import hookspecs

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / ".ci" / "hooks_reference.py"


@pytest.fixture(scope="module")
def script() -> types.ModuleType:
    return ci_script(SCRIPT)


def hook_names() -> list[str]:
    return [name for name in dir(hookspecs) if name.startswith("tokenmill_")]


def test_hooks_md_reference_matches_the_hookspec_docstrings(script):
    diff = script.stale_diff((ROOT / "hooks.md").read_text())
    assert not diff, f"hooks.md is stale; run python .ci/hooks_reference.py\n{diff}"


def test_the_check_command_passes_on_hooks_md_and_fails_with_a_diff_on_a_stale_copy(tmp_path):
    assert subprocess.run([sys.executable, str(SCRIPT), "--check"], check=False, cwd=ROOT).returncode == 0
    stale = tmp_path / "hooks.md"
    stale.write_text((ROOT / "hooks.md").read_text().replace("Offer engine backends.", "Offer backends."))
    result = subprocess.run([sys.executable, str(SCRIPT), "--check", "--path", str(stale)],
                            check=False, capture_output=True, text=True)
    assert result.returncode == 1
    assert "-Offer backends." in result.stderr and "+Offer engine backends." in result.stderr


def test_every_hook_is_in_the_reference_in_hookspecs_order(script):
    names = [func.__name__ for func in script.hook_functions(hookspecs)]
    assert sorted(names) == hook_names()
    block = script.reference_block(hookspecs)
    headings = [line for line in block.splitlines() if line.startswith("### ")]
    assert headings == [f"### `{script.signature_text(getattr(hookspecs, name))}`" for name in names]
    assert headings[0] == "### `tokenmill_backends() -> list[Backend]`"
    assert ("### `tokenmill_request_finished(request_id: str, finish_reason: str | None, "
            "generated_tokens: int, error: str | None) -> None`") in headings


@pytest.mark.parametrize("name", hook_names())
def test_every_hookspec_docstring_says_when_it_is_called_what_it_receives_and_returns(name):
    doc = getattr(hookspecs, name).__doc__ or ""
    assert doc.strip(), f"{name} has no docstring"
    for word in ("Called", "Receives", "Returns"):
        assert word in doc, f"{name}'s docstring does not say what it is {word.lower()}"
    assert ":class:" not in doc and "``" not in doc, f"{name}'s docstring is rendered as Markdown, not reST"
