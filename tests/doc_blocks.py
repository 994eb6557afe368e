"""The fenced blocks of every doc, the commands in them and the shapes of what they print, for
tests/test_docs.py (whose docstring is the convention)."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


NOT_DOCS = ("bench/results/", "bench/out/")
"""Folders whose Markdown is output, not docs (besides hidden folders, ``build``, ``dist``, ``*.egg-info``)."""


def doc_files() -> list[Path]:
    """Every Markdown file of the repository that is a doc."""
    found = []
    for path in sorted(ROOT.rglob("*.md")):
        relative = path.relative_to(ROOT)
        folders = relative.parts[:-1]
        if any(part.startswith(".") or part in ("build", "dist", "__pycache__") or part.endswith(".egg-info")
               for part in folders) or relative.as_posix().startswith(NOT_DOCS):
            continue
        found.append(path)
    return found


DOC_FILES = doc_files()


CI_RUN = ROOT / ".ci" / "run"


DOCS_PORT = 3000


SHELL_LANGUAGES = ("sh", "bash", "shell", "console", "zsh")


COMMAND_LANGUAGES = ("sh", "console", "python")
"""Fences whose text is commands; any other fence is text."""


KNOWN_COMMANDS = {"curl", "wget", "tokenmill", "python", "python3", "pip", "pip3", "docker", "kubectl", "helm",
                  "nginx", "envoy", "bash", "sh", "sudo", "apt-get", "git", "pytest", "mkdir", "chown", "export"}
"""First words that make a line of a text fence a command hidden from the rules."""


FENCE = re.compile(r"^( *)```([^`]*)$")
"""A fence's opening line: its indent (inside a list item) and its info string."""


ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")
OUTPUT_COMMENT = re.compile(r"^# (data: )?[\[{]")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    language: str
    tags: tuple[str, ...]
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


@dataclass
class Command:
    text: str
    shapes: list[str]


def fenced_blocks(path: Path) -> Iterator[Block]:
    """The fenced code blocks of one Markdown file, indented ones (in a list item) included."""
    lines = path.read_text().splitlines()
    index = 0
    while index < len(lines):
        fence = FENCE.match(lines[index])
        if fence:
            indent = len(fence.group(1))
            words = fence.group(2).split()
            start, body = index + 1, []
            index += 1
            while index < len(lines) and lines[index].strip() != "```":
                body.append(lines[index][indent:])
                index += 1
            yield Block(path, start, words[0] if words else "", tuple(words[1:]), "\n".join(body) + "\n")
        index += 1


BLOCKS = [block for path in DOC_FILES for block in fenced_blocks(path)]


RUN_BLOCKS = [block for block in BLOCKS if block.language == "sh" and not block.tags]


CHECK_BLOCKS = [block for block in BLOCKS if block.language == "sh" and block.tags == ("check",)]


CONSOLE_BLOCKS = [block for block in BLOCKS if block.language == "console" and not block.tags]


PYTHON_BLOCKS = [block for block in BLOCKS if block.language == "python"]


def complete(text: str) -> bool:
    if text.endswith("\\"):
        return False
    try:
        shlex.split(text, comments=True)
    except ValueError:  # a quote still open: the command goes on on the next line
        return False
    return True


def commands(block: Block) -> list[Command]:
    """The block's commands (continued over lines by ``\\`` or an open quote), each with the shape
    comments right after it."""
    found: list[Command] = []
    pending: list[str] = []
    after_command = False
    for line in block.text.splitlines():
        if pending:
            pending.append(line)
            if complete("\n".join(pending)):
                found.append(Command("\n".join(pending), []))
                pending, after_command = [], True
            continue
        if not line.strip():
            after_command = False
        elif line.startswith("#"):
            if after_command and OUTPUT_COMMENT.match(line):
                found[-1].shapes.append(line[2:])
            else:
                after_command = False
        else:
            pending = [line]
            if complete(line):
                found.append(Command(line, []))
                pending, after_command = [], True
    assert not pending, f"{block.where}: a command does not end: {pending}"
    return found


def shape_mismatch(expected: Any, actual: Any, where: str = "$") -> str | None:
    """Where ``actual`` differs from ``expected`` in shape (keys, types, list lengths), else None."""
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return f"{where}: an object expected, got {actual!r}"
        if set(expected) != set(actual):
            return f"{where}: keys {sorted(actual)}, the doc shows {sorted(expected)}"
        return next((m for key in expected if (m := shape_mismatch(expected[key], actual[key], f"{where}.{key}"))),
                    None)
    if isinstance(expected, list):
        if not isinstance(actual, list) or len(actual) != len(expected):
            return f"{where}: a list of {len(expected)} expected, got {actual!r}"
        return next((m for i, (e, a) in enumerate(zip(expected, actual, strict=True))
                     if (m := shape_mismatch(e, a, f"{where}[{i}]"))), None)
    if isinstance(expected, bool) or expected is None or isinstance(expected, str):
        same = type(actual) is type(expected)
    else:  # a number: int or float alike
        same = isinstance(actual, (int, float)) and not isinstance(actual, bool)
    return None if same else f"{where}: {type(expected).__name__} expected, got {actual!r}"


def check_shapes(command: Command, output: str, where: str) -> None:
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == len(command.shapes), (f"{where}: {len(lines)} output lines, the doc shows "
                                               f"{len(command.shapes)}:\n{output}")
    for shown, line in zip(command.shapes, lines, strict=True):
        prefix = "data: " if shown.startswith("data: ") else ""
        assert line.startswith(prefix), f"{where}: {line!r} does not start with {prefix!r}"
        expected = json.loads(shown[len(prefix):])
        mismatch = shape_mismatch(expected, json.loads(line[len(prefix):]))
        assert mismatch is None, f"{where}: {mismatch}\n  printed: {line}\n  the doc: {shown}"


def console_session(block: Block) -> list[tuple[str, list[str]]]:
    """A console block's commands (``$ `` lines, continued while incomplete), each with the lines it prints."""
    session: list[tuple[str, list[str]]] = []
    pending: list[str] = []
    for line in block.text.rstrip("\n").splitlines():
        if pending:
            pending.append(line)
        elif line.startswith("$ "):
            pending = [line[2:]]
        else:
            assert session, f"{block.where}: output before the first `$ ` command: {line!r}"
            session[-1][1].append(line)
            continue
        if complete("\n".join(pending)):
            session.append(("\n".join(pending), []))
            pending = []
    assert not pending, f"{block.where}: a command does not end: {pending}"
    return session


def hidden_command(line: str) -> str | None:
    """The command a line of a text fence starts with, if it starts with one."""
    text = line.strip().removeprefix("$ ")
    if re.match(r"[\w.-]+\s+=|[\w.-]+:\s", text):
        return None  # a config line (``key = value``, ``key: value``)
    words = text.split()
    while words and ASSIGNMENT.match(words[0]):
        words = words[1:]
    first = words[0].rpartition("/")[2] if words else ""
    return first if first in KNOWN_COMMANDS else None


def prose(path: Path) -> str:
    """A doc's text outside its fenced blocks."""
    kept, inside = [], False
    for line in path.read_text().splitlines():
        if inside:
            inside = line.strip() != "```"
        elif FENCE.match(line):
            inside = True
        else:
            kept.append(line)
    return "\n".join(kept)


def bench_spans() -> list[tuple[Path, str]]:
    """Each inline code span of the docs' prose that is a ``python -m bench`` command."""
    return [(path, " ".join(span.split())) for path in DOC_FILES
            for span in re.findall(r"`(python -m bench[^`]*)`", prose(path))]


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
