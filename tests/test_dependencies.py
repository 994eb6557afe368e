"""A plain ``pip install tokenmill`` starts: every package that tokenmill's modules import as they load is one
pyproject.toml names as a dependency. (httpx came only with the test extra for a while: an image built with
``pip install .`` stopped at its first import.) Optional extras are imported inside functions, so they are not
counted; neither are imports under ``try`` or ``if TYPE_CHECKING``."""

from __future__ import annotations

import ast
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = {"tokenmill", "tokenmill_plugins"}


def declared_dependencies() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {canonicalize_name(Requirement(line).name) for line in project["dependencies"]}


def imported_as_modules_load(source: Path) -> set[str]:
    """The top-level names a module imports in its own body (not in functions, ``try`` or ``if`` blocks)."""
    names: set[str] = set()
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def third_party_imports() -> dict[str, set[str]]:
    """Each third-party top-level name imported as a module loads, with the files that import it."""
    imports: dict[str, set[str]] = {}
    sources = [*(ROOT / "core" / "tokenmill").rglob("*.py"), *(ROOT / "plugins" / "tokenmill_plugins").rglob("*.py")]
    for source in sources:
        for name in imported_as_modules_load(source) - FIRST_PARTY - set(sys.stdlib_module_names):
            imports.setdefault(name, set()).add(str(source.relative_to(ROOT)))
    return imports


def test_every_package_imported_as_tokenmill_loads_is_a_declared_dependency() -> None:
    declared = declared_dependencies()
    distributions = packages_distributions()
    undeclared = {name: sorted(files)[:3] for name, files in third_party_imports().items()
                  if not {canonicalize_name(d) for d in distributions.get(name, [name])} & declared}
    assert not undeclared, f"imported as modules load but not in pyproject.toml's dependencies: {undeclared}"
