"""The architecture's rules, checked on the static import graph of core/, plugins/ and bench/.

core/ and plugins/ are source roots: each folder under them is the package it holds
(core/tokenmill/engine/step.py is ``tokenmill.engine.step``), so a module's name is its path, read with no
mapping; plugins/packages/ holds separately installed distributions and is left out. The repository root is
bench/'s source root. Every ``.py`` is parsed with ``ast``; nothing is imported. An *arrow* is one runtime
import of ``tokenmill...``, ``tokenmill_plugins...``, ``bench...`` or ``falcon...``:

* imports inside functions count (a lazy import is still a dependency);
* imports under ``if TYPE_CHECKING:`` do not (they never run), though its ``else:`` branch does;
* relative imports are resolved against the importing module;
* ``from pkg import name`` points at ``pkg.name`` when that is a module, else at ``pkg``.

No arrows go round in a circle. The modules at the old import paths that hooks 1.0 promised plugin authors
(``tokenmill.admission`` and the rest of ``OLD_PATHS``) only re-export; nothing in the tree imports them.

Layers, top to bottom (a module may import its own layer or lower ones, never a higher one)::

    tokenmill.cli, tokenmill.__main__
    tokenmill.http
    tokenmill.engine
    tokenmill.sampling, tokenmill.model, tokenmill.kernels, tokenmill.observability, tokenmill.parsing
    tokenmill.interfaces

Beside the layers stand the shared foundations ``tokenmill`` (the package root), ``tokenmill.config``,
``tokenmill.hookspecs`` and ``tokenmill.plugin_manager``: anything may import them, and they may
import anything but the HTTP side and the CLI.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_import_paths import OLD_PATHS as PROMISED_OLD_PATHS

ROOT = Path(__file__).resolve().parent.parent
SOURCE_ROOTS = (ROOT / "core", ROOT / "plugins", ROOT)
PACKAGES = ("tokenmill", "tokenmill_plugins", "bench")  # the packages each source root's folders hold
CORE = ROOT / "core" / "tokenmill"
TRACKED_ROOTS = (*PACKAGES, "falcon")
OLD_PATHS = tuple(PROMISED_OLD_PATHS)  # the hooks 1.0 paths, kept only as re-exports

ENGINE_THREAD = ("tokenmill.engine", "tokenmill.sampling", "tokenmill.model", "tokenmill.kernels",
                 "tokenmill.parsing", "tokenmill.interfaces")
HTTP_SIDE = ("tokenmill.http", "falcon")
FRONT_END = ("tokenmill.http", "tokenmill.cli")
LAYERS: tuple[tuple[str, ...], ...] = (  # top to bottom
    ("tokenmill.cli", "tokenmill.__main__"),
    ("tokenmill.http",),
    ("tokenmill.engine",),
    ("tokenmill.sampling", "tokenmill.model", "tokenmill.kernels", "tokenmill.observability", "tokenmill.parsing"),
    ("tokenmill.interfaces",),
)
CONFIG_MODULES = ("tokenmill.config", "tokenmill.config.settings", "tokenmill.config.flags",
                  "tokenmill.config.launcher")
FOUNDATIONS = ("tokenmill", *CONFIG_MODULES, "tokenmill.hookspecs", "tokenmill.plugin_manager")
INTERFACES_MAY_IMPORT = ("tokenmill", "tokenmill.config")

MAX_CORE_MODULE_LINES = 400
ENGINE_LOOP_MODULES = tuple(f"core/tokenmill/engine/{name}.py"
                            for name in ("engine", "scheduler", "kv_cache", "step", "output"))
MAX_ENGINE_CORE_LINES = 900  # engine.py + scheduler.py + kv_cache.py + step.py (issue 42; each also under 400)
PAGED_RUNNER = "plugins/tokenmill_plugins/backends/paged/runner.py"
MAX_PAGED_RUNNER_LINES = 250
PROGRESS_WRITERS = ("core/tokenmill/engine/scheduler.py", "core/tokenmill/engine/kv_cache.py",
                    "core/tokenmill/engine/runner_kv.py")
"""Where a sequence's progress (``num_computed``) may be assigned: the scheduler's update, and the KV-cache
manager (for the engine's pool, or a runner's own) where what the KV holds changes."""
MAX_CORE_TOP_LEVEL_MODULES = 8


# --- the import graph ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SourceModule:
    name: str
    path: Path
    is_package: bool


@dataclass(frozen=True, order=True)
class Arrow:
    source: str
    target: str
    where: str  # path:line, relative to the repository root

    def __str__(self) -> str:
        return f"{self.source} -> {self.target}  ({self.where})"


def module_name(path: Path, root: Path) -> str:
    """The module a file is, from its path under its source root: tokenmill/x/y.py -> tokenmill.x.y and
    tokenmill/x/__init__.py -> tokenmill.x."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_module(path: Path, root: Path) -> SourceModule:
    return SourceModule(module_name(path, root), path, path.name == "__init__.py")


def source_modules() -> dict[str, SourceModule]:
    modules: dict[str, SourceModule] = {}
    for root in SOURCE_ROOTS:
        for package in PACKAGES:
            if (root / package / "__init__.py").is_file():
                for path in sorted((root / package).rglob("*.py")):
                    module = source_module(path, root)
                    modules[module.name] = module
    return modules


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def runtime_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that can run, at any depth, less the bodies of ``if TYPE_CHECKING:``."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def from_base(module: SourceModule, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` reads from."""
    if node.level == 0:
        return node.module or ""
    package = module.name if module.is_package else module.name.rpartition(".")[0]
    parts = package.split(".")
    if node.level - 1 >= len(parts):
        raise ValueError(f"{module.path}:{node.lineno}: relative import climbs above {parts[0]}")
    base = ".".join(parts[: len(parts) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


def import_targets(module: SourceModule, node: ast.Import | ast.ImportFrom, known: Iterable[str]) -> Iterator[str]:
    """The modules one import statement points at."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = from_base(module, node)
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        yield submodule if submodule in known else base


def is_tracked(target: str) -> bool:
    return target.split(".")[0] in TRACKED_ROOTS


def location(path: Path, line: int) -> str:
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return f"{shown}:{line}"


def module_arrows(module: SourceModule, known: Iterable[str]) -> list[Arrow]:
    tree = ast.parse(module.path.read_text(), filename=str(module.path))
    return [
        Arrow(module.name, target, location(module.path, node.lineno))
        for node in runtime_imports(tree)
        for target in import_targets(module, node, known)
        if is_tracked(target)
    ]


def build_graph(modules: dict[str, SourceModule]) -> list[Arrow]:
    known = set(modules)
    return sorted({arrow for module in modules.values() for arrow in module_arrows(module, known)})


def cycles(arrows: Iterable[Arrow]) -> list[list[str]]:
    """The import circles: each strongly connected component of more than one module (or a module that imports
    itself), found with Tarjan's algorithm."""
    graph: dict[str, set[str]] = {}
    for arrow in arrows:
        graph.setdefault(arrow.source, set()).add(arrow.target)
        graph.setdefault(arrow.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.fixture(scope="module")
def modules() -> dict[str, SourceModule]:
    return source_modules()


@pytest.fixture(scope="module")
def arrows(modules: dict[str, SourceModule]) -> list[Arrow]:
    return build_graph(modules)


# --- rule helpers -------------------------------------------------------------------------------


def within(module: str, packages: Iterable[str]) -> bool:
    """Whether ``module`` is one of ``packages`` or lies under one of them."""
    return any(module == package or module.startswith(package + ".") for package in packages)


def layer(module: str) -> int | None:
    """The module's layer, 0 at the top; None for the foundations and anything outside the layers."""
    return next((rank for rank, packages in enumerate(LAYERS) if within(module, packages)), None)


def offending(arrows: Iterable[Arrow], is_bad: Callable[[Arrow], bool]) -> list[Arrow]:
    return [arrow for arrow in arrows if is_bad(arrow)]


def report(rule: str, bad: list[Arrow]) -> str:
    return f"{rule} — {len(bad)} offending import(s):\n" + "\n".join(f"  {arrow}" for arrow in bad)


def plugin_of(module: str) -> str | None:
    """``tokenmill_plugins.<kind>.<name>`` for a module inside a plugin, None for the package inits above."""
    parts = module.split(".")
    return ".".join(parts[:3]) if parts[0] == "tokenmill_plugins" and len(parts) >= 3 else None


def line_count(path: Path) -> int:
    return len(path.read_text().splitlines())


# --- the walker itself --------------------------------------------------------------------------


def test_the_walker_counts_lazy_imports_resolves_relative_ones_and_skips_type_checking_blocks(tmp_path: Path) -> None:
    package = tmp_path / "tokenmill" / "engine"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "sequence.py").write_text("")
    (package / "engine.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import sequence\n"
        "from .. import config, hookimpl\n"
        "import tokenmill.loading\n"
        "if TYPE_CHECKING:\n"
        "    from tokenmill.http import app\n"
        "else:\n"
        "    import falcon.asgi\n"
        "def later():\n"
        "    from tokenmill.model import loading\n"
    )
    (package.parent / "config.py").write_text("")
    found = {module.name: module for module in (source_module(p, tmp_path) for p in tmp_path.rglob("*.py"))}
    found["tokenmill.model.loading"] = SourceModule("tokenmill.model.loading", tmp_path / "absent.py", False)
    targets = sorted(arrow.target for arrow in module_arrows(found["tokenmill.engine.engine"], set(found)))
    assert targets == [
        "falcon.asgi", "tokenmill", "tokenmill.config", "tokenmill.engine.sequence",
        "tokenmill.loading", "tokenmill.model.loading",
    ]


def test_a_file_is_the_module_its_path_under_the_source_root_names() -> None:
    assert module_name(ROOT / "core" / "tokenmill" / "engine" / "step.py", ROOT / "core") == "tokenmill.engine.step"
    assert module_name(ROOT / "plugins" / "tokenmill_plugins" / "kv" / "__init__.py", ROOT / "plugins") == (
        "tokenmill_plugins.kv")


def test_the_circle_finder_finds_circles_through_any_number_of_modules() -> None:
    def arrow(source: str, target: str) -> Arrow:
        return Arrow(source, target, "here:1")

    assert cycles([arrow("a", "b"), arrow("b", "c")]) == []
    assert cycles([arrow("a", "b"), arrow("b", "c"), arrow("c", "a"), arrow("c", "d")]) == [["a", "b", "c"]]
    assert cycles([arrow("a", "a")]) == [["a"]]


def test_the_import_graph_covers_core_plugins_and_bench(modules: dict[str, SourceModule], arrows: list[Arrow]) -> None:
    assert {"tokenmill", "tokenmill.engine", "tokenmill.http", "tokenmill_plugins", "bench"} <= set(modules)
    assert not any(name.startswith(("tokenmill_plugins.packages", "tokenmill_example", "tokenmill_vllm"))
                   for name in modules)
    assert modules["tokenmill.engine.step"].path == CORE / "engine" / "step.py"
    assert arrows, "no imports found at all: the walker is broken"


def test_no_imports_go_round_in_a_circle(arrows: list[Arrow]) -> None:
    """No module reaches itself through imports, counting those inside functions, in core/, plugins/ or bench/."""
    found = cycles(arrows)
    assert not found, "import circles:\n" + "\n".join(
        "  " + " <-> ".join(circle) + "\n" + "\n".join(
            f"    {arrow}" for arrow in arrows if arrow.source in circle and arrow.target in circle)
        for circle in found)


def test_nothing_in_the_tree_imports_an_old_path(arrows: list[Arrow]) -> None:
    """The hooks 1.0 paths are kept for third-party plugins only; tokenmill's own code imports the new ones."""
    bad = offending(arrows, lambda a: within(a.target, OLD_PATHS))
    assert not bad, report("imports of deprecated old paths", bad)


# --- rule 1: the engine thread never reaches the HTTP side ----------------------------------------


def test_engine_thread_packages_never_import_the_http_side(arrows: list[Arrow]) -> None:
    """engine, sampling, model, kernels and interfaces never import tokenmill.http (or below) or falcon."""
    bad = offending(arrows, lambda a: within(a.source, ENGINE_THREAD) and within(a.target, HTTP_SIDE))
    assert not bad, report("the engine thread's packages import the HTTP side", bad)


# --- rule 2: arrows point down --------------------------------------------------------------------


def test_every_core_module_has_a_place_in_the_layering(modules: dict[str, SourceModule]) -> None:
    """A new core module joins a layer or the foundations; otherwise no layering rule would see it."""
    unplaced = [name for name in modules if name.startswith("tokenmill.") and layer(name) is None
                and name not in FOUNDATIONS and name not in OLD_PATHS]
    assert not unplaced, f"core modules outside every layer and the foundations: {unplaced}"


def test_imports_never_point_up_the_layers(arrows: list[Arrow]) -> None:
    """cli > http > engine > (sampling, model, kernels, observability, parsing) > interfaces: import down or
    sideways."""
    def points_up(arrow: Arrow) -> bool:
        source, target = layer(arrow.source), layer(arrow.target)
        return source is not None and target is not None and target < source

    bad = offending(arrows, points_up)
    assert not bad, report("imports point up the layers", bad)


def test_shared_foundations_never_import_http_or_cli(arrows: list[Arrow]) -> None:
    """tokenmill, config, hookspecs and plugin_manager are importable from anywhere, so they stay below the front
    end."""
    bad = offending(arrows, lambda a: a.source in FOUNDATIONS and within(a.target, FRONT_END))
    assert not bad, report("the shared foundations import the HTTP side or the CLI", bad)


def test_interfaces_import_only_the_package_root_and_config(arrows: list[Arrow]) -> None:
    """At runtime tokenmill.interfaces needs only ``tokenmill`` (hookimpl, version) and tokenmill.config."""
    def strays(arrow: Arrow) -> bool:
        return (within(arrow.source, ["tokenmill.interfaces"]) and arrow.target not in INTERFACES_MAY_IMPORT
                and not within(arrow.target, ["tokenmill.interfaces"]))

    bad = offending(arrows, strays)
    assert not bad, report("tokenmill.interfaces imports more than tokenmill and tokenmill.config", bad)


# --- rule 3: plugins stand alone ------------------------------------------------------------------


def test_a_plugin_never_imports_another_plugin(arrows: list[Arrow]) -> None:
    """tokenmill_plugins.<kind>.<name> imports only itself and its own package inits from tokenmill_plugins."""
    def crosses(arrow: Arrow) -> bool:
        plugin = plugin_of(arrow.source)
        if plugin is None or not within(arrow.target, ["tokenmill_plugins"]):
            return False
        own_inits = {"tokenmill_plugins", plugin.rpartition(".")[0]}
        return arrow.target not in own_inits and not within(arrow.target, [plugin])

    bad = offending(arrows, crosses)
    assert not bad, report("plugins import other plugins", bad)


def test_plugins_never_import_http_or_cli(arrows: list[Arrow]) -> None:
    """Plugins build on tokenmill's core, never on its front end."""
    bad = offending(arrows, lambda a: within(a.source, ["tokenmill_plugins"]) and within(a.target, FRONT_END))
    assert not bad, report("plugins import the HTTP side or the CLI", bad)


# --- rule 4: sizes --------------------------------------------------------------------------------


def test_no_core_module_is_over_400_lines() -> None:
    sizes = {str(path.relative_to(ROOT)): line_count(path) for path in sorted(CORE.rglob("*.py"))}
    big = {path: lines for path, lines in sizes.items() if lines > MAX_CORE_MODULE_LINES}
    assert not big, f"core modules over {MAX_CORE_MODULE_LINES} lines: {big}"


def test_the_engine_loop_lives_in_its_modules_and_its_core_stays_under_900_lines() -> None:
    missing = [relative for relative in ENGINE_LOOP_MODULES if not (ROOT / relative).is_file()]
    names = [Path(module).name for module in ENGINE_LOOP_MODULES]
    assert not missing, f"{missing} do not exist: the engine loop lives in {names}"
    lines = {relative: line_count(ROOT / relative) for relative in ENGINE_LOOP_MODULES[:4]}
    assert sum(lines.values()) <= MAX_ENGINE_CORE_LINES, f"the engine's core is {lines}: over {MAX_ENGINE_CORE_LINES}"


def test_the_paged_runner_is_small_and_knows_nothing_of_the_engine() -> None:
    source = (ROOT / PAGED_RUNNER).read_text()
    assert line_count(ROOT / PAGED_RUNNER) <= MAX_PAGED_RUNNER_LINES
    imported = [line for line in source.splitlines() if line.lstrip().startswith(("import ", "from "))]
    assert not [line for line in imported if "tokenmill.engine" in line], "it packs the tables the engine gives it"


def test_a_sequences_progress_is_assigned_only_by_the_scheduler_and_the_kv_cache_manager() -> None:
    assignment = re.compile(r"\bnum_computed\s*(?:[-+]?=)(?!=)")
    writers = {str(path.relative_to(ROOT)) for root in (CORE, ROOT / "plugins" / "tokenmill_plugins")
               for path in root.rglob("*.py") if assignment.search(path.read_text())}
    allowed = {*PROGRESS_WRITERS, "core/tokenmill/engine/sequence.py"}  # where the field starts at 0
    assert writers <= allowed, f"num_computed assigned in {sorted(writers - allowed)}"


def test_core_top_level_holds_at_most_8_modules() -> None:
    top = sorted(path.name for path in CORE.glob("*.py") if f"tokenmill.{path.stem}" not in OLD_PATHS)
    assert len(top) <= MAX_CORE_TOP_LEVEL_MODULES, (
        f"core/tokenmill/ holds {len(top)} top-level modules (at most {MAX_CORE_TOP_LEVEL_MODULES}): {top}"
    )


def test_each_request_shape_is_stated_once_and_validation_keeps_only_what_needs_the_server() -> None:
    """The pydantic models state each field's type and bounds; nothing re-reads a raw body field by
    field, and validation holds only the checks that need the tokenizer, the vocabulary or a limit."""
    rereading = [path for path in CORE.rglob("*.py") if "typed_field" in path.read_text()]
    assert not rereading, f"raw bodies read field by field in {rereading}"
    assert line_count(CORE / "http" / "tgi" / "validation.py") <= 155  # 150, and a prompt's images


def test_the_request_shapes_import_no_torch() -> None:
    shapes = "tokenmill.http.tgi.schemas", "tokenmill.http.openai.schemas", "tokenmill.http.schemas.ops"
    probe = f"import sys\nfor name in {shapes!r}: __import__(name)\nprint('torch' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "False"
