"""The rules that check a doc's ```sh check commands without running them, for tests/test_docs.py (whose
docstring lists them)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from importlib.metadata import metadata
from pathlib import Path
from typing import Any

import pytest
from doc_blocks import ASSIGNMENT, BLOCKS, CI_RUN, DOCS_PORT, ROOT, Block, commands
from test_gateway import NGINX
from test_image import MANIFESTS, arguments_of, dockerfile_stages, env_of

from bench import cli
from tokenmill.config import parse_config

PRELUDE = 'set -euo pipefail\ncurl() { command curl --fail-with-body --max-time 60 "$@"; }\n'


def command_env() -> dict[str, str]:
    """This interpreter's ``python`` and ``tokenmill`` first on PATH; no third-party plugins."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "PATH": path, "TOKENMILL_DISABLE_PLUGIN_AUTOLOAD": "1"}


@dataclass
class Facts:
    """What a doc's commands have set up so far, which its later commands may use."""

    variables: set[str] = field(default_factory=lambda: {"PWD", "HOME"})
    directories: set[str] = field(default_factory=set)
    images: set[str] = field(default_factory=set)
    published: dict[str, str] = field(default_factory=dict)
    """Host port to container port, by ``docker run -p``."""
    packages: list[Path] = field(default_factory=list)
    """Plugin packages of this checkout that ``pip install`` installed."""
    venvs: set[str] = field(default_factory=set)
    tokenmill_without_deps: bool = False
    launched: bool = False
    gateway_configs: dict[str, list[str]] = field(default_factory=dict)
    """The file ``tokenmill gateway-config ARGS > FILE`` wrote, and ARGS."""


PLACEHOLDERS = {"volume", "model"}
"""TGI's README's variables for the reader's own directory and model: a flag value, or a ``-v`` source."""


VARIABLE = re.compile(r"\$\{?(\w+)")


def ci_commands() -> list[str]:
    """Every command .ci/run runs: its lines, and each part of a line joined with ``&&``."""
    text = CI_RUN.read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    return lines + [part.strip() for line in lines for part in line.split("&&")]


def pins_of(commands: list[list[str]]) -> dict[str, str]:
    pins: dict[str, str] = {}
    for words in commands:
        if words[:2] == ["pip", "install"]:
            for word in words[2:]:
                if not word.startswith("-") and "{" not in word:
                    pins[re.split(r"[=<>\[]", word)[0]] = word
    return pins


def ci_pins() -> dict[str, str]:
    """What .ci/run's and the peers' set-up's ``pip install``s name: each requirement by its distribution name."""
    from bench import peers

    steps = [step for steps in peers.SETUP_STEPS.values() for step in steps]
    return {**pins_of(steps), **pins_of([shlex.split(command) for command in ci_commands()])}


@cache
def tokenmill_requirements() -> frozenset[str]:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return frozenset(re.split(r"[<>=!~ ;\[]", requirement)[0] for requirement in project["dependencies"])


@cache
def source_text(package: Path) -> str:
    return "\n".join(path.read_text() for path in sorted(package.rglob("*.py")) if "build" not in path.parts)


def check_pip_install(words: list[str], facts: Facts) -> None:
    from bench import peers

    extras = set(metadata("tokenmill").get_all("Provides-Extra") or ())
    pins = ci_pins()
    by_name = []
    for word in words[2:]:
        if word.startswith("-"):
            continue
        name, _, rest = word.partition("[")
        wanted = set(rest.rstrip("]").split(",")) - {""}
        if name == "." or name == "tokenmill":
            assert wanted <= extras, f"{word}: tokenmill has no extra {sorted(wanted - extras)}"
        elif name.startswith("./"):
            assert (ROOT / name / "pyproject.toml").is_file(), f"{word}: no package at {name}"
        elif re.fullmatch(r"[A-Za-z0-9_.-]+", word) and pins.get(word) != word:
            assert word in tokenmill_requirements(), f"{word}: not pinned, and not a requirement of tokenmill"
            by_name.append(word)
        else:
            base = re.split(r"[=<>]", word)[0]
            assert pins.get(base) == word, f"{word}: .ci/run and bench.peers install {pins.get(base)!r}"
    if by_name and facts.tokenmill_without_deps:
        wanted = tokenmill_requirements() - set(peers.VLLM_OWNED)
        assert set(by_name) == wanted, (f"{' '.join(words)}: after `pip install --no-deps .` install tokenmill's "
                                        f"requirements but vLLM's (bench.peers.VLLM_OWNED): missing "
                                        f"{sorted(wanted - set(by_name))}, extra {sorted(set(by_name) - wanted)}")


def check_pip_uninstall(words: list[str]) -> None:
    from bench import peers

    steps = [step for steps in peers.SETUP_STEPS.values() for step in steps]
    assert words in steps, f"{' '.join(words)}: not a step of bench.peers.SETUP_STEPS ({steps})"


def check_launch(words: list[str], env: dict[str, str]) -> None:
    config = parse_config(words[2:], env=env)
    assert config.port, words


def check_docker(words: list[str], facts: Facts) -> None:
    stages = dockerfile_stages()
    runtime = [stage for name, stage in stages.items() if name in ("cpu", "cuda")]
    options = {"-t", "--tag", "--target", "-p", "-v", "-e", "--env", "--shm-size", "--gpus", "--user", "--name"}
    values: dict[str, list[str]] = {}
    rest: list[str] = []
    iterator = iter(words[2:])
    for word in iterator:
        if word in options:
            values.setdefault(word, []).append(next(iterator))
        elif word.startswith("-") and not rest:
            continue  # --rm, -it, -d
        else:
            rest.append(word)
    if words[1] == "build":
        assert rest == ["."] and (ROOT / "Dockerfile").is_file(), words
        for target in values.get("--target", []):
            assert target in stages, f"the Dockerfile has no target {target!r} ({sorted(stages)})"
        return
    if words[1] == "push":
        assert rest and rest[0] in facts.images, f"docker push {rest}: no `docker build -t` before made it"
        return
    assert words[1] == "run" and rest, words
    assert rest[0] in facts.images, f"docker run {rest[0]}: no `docker build -t` before made it"
    env = dict(pair.split("=", 1) for pair in values.get("-e", []) + values.get("--env", []) if "=" in pair)
    for mapping in values.get("-p", []):
        inside = mapping.rsplit(":", 1)[1]
        assert all(env.get("PORT", env_of(stage)["PORT"]) == inside for stage in runtime), (
            f"-p {mapping}: the image listens on PORT")
    for volume in values.get("-v", []):
        assert all(arguments_of(stage, "VOLUME") == [volume.split(":")[1]] for stage in runtime), volume
    parse_config(rest[1:], env={})


@cache
def manifest_documents() -> list[dict[str, Any]]:
    yaml = pytest.importorskip("yaml", reason="pyyaml is not installed")
    return [document for path in MANIFESTS for document in yaml.safe_load_all(path.read_text()) if document]


def secrets_read() -> set[tuple[str, str]]:
    """Each (secret, key) a manifest reads through ``secretKeyRef``."""
    found: set[tuple[str, str]] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("secretKeyRef"), dict):
                found.add((node["secretKeyRef"]["name"], node["secretKeyRef"]["key"]))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(manifest_documents())
    return found


def check_kubectl(words: list[str]) -> None:
    if words[1:4] == ["create", "secret", "generic"]:
        keys = [word.split("=", 2)[1] for word in words if word.startswith("--from-literal=")]
        assert keys, words
        for key in keys:
            assert (words[4], key) in secrets_read(), (f"secret {words[4]!r} key {key!r}: no manifest reads it "
                                                        f"({sorted(secrets_read())})")
        return
    assert words[:2] == ["kubectl", "apply"], words
    named = [Path(words[i + 1]) for i, word in enumerate(words) if word == "-f"]
    assert named, words
    for path in named:
        files = sorted((ROOT / path).glob("*.yaml")) if (ROOT / path).is_dir() else [ROOT / path]
        for file in files:
            assert file in MANIFESTS, f"{path}: not among the manifests tests/test_image.py validates"


def check_directories(words: list[str], facts: Facts) -> None:
    """``mkdir -p DIR...``, ``chown UID:GID DIR...`` (the image's user, a directory made before)."""
    if words[0] == "mkdir":
        assert all(word == "-p" or not word.startswith("-") for word in words[1:]), words
        return
    users = {arguments for name, stage in dockerfile_stages().items() if name in ("cpu", "cuda")
             for arguments in arguments_of(stage, "USER")}
    assert len(words) >= 3 and words[1] in users, f"{' '.join(words)}: the image runs as {sorted(users)}"
    for path in words[2:]:
        assert path in facts.directories, f"chown {path}: not a directory a `mkdir` before made"


def run_parser(command_line: argparse.ArgumentParser, args: list[str], what: str) -> argparse.Namespace:
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            return command_line.parse_args(args)
    except SystemExit:
        raise AssertionError(f"{what}: {said.getvalue().strip()}") from None


def bench_parser(words: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The parser of ``python -m bench[.MODULE] ARGS`` and the arguments it gets, as bench/cli.py routes them."""
    module_name, args = words[2], list(words[3:])
    if module_name == "bench":
        return cli.parser_for(args)
    assert (ROOT / "bench" / f"{module_name.removeprefix('bench.')}.py").is_file(), f"{module_name}: no module"
    module = importlib.import_module(module_name)
    assert hasattr(module, "parser"), f"{module_name} has no parser() to check its arguments with"
    return module.parser(), args


def check_bench(words: list[str]) -> None:
    command_line, args = bench_parser(words)
    parsed = run_parser(command_line, args, " ".join(words))
    if getattr(parsed, "from_json", None):
        assert (ROOT / parsed.from_json).is_file(), f"--from-json {parsed.from_json}: no such file"


def nginx_options(words: list[str]) -> dict[str, str]:
    options: dict[str, str] = {}
    iterator = iter(words[1:])
    for word in iterator:
        if word in ("-p", "-c", "-g"):
            options[word] = next(iterator)
        else:
            assert word in ("-t", "-T", "-q"), f"nginx {word}: no rule checks it"
    return options


def check_nginx(words: list[str], facts: Facts, scratch: Path) -> None:
    options = nginx_options(words)
    config = options.get("-c", "")
    name = config.removeprefix("$PWD/")
    assert name in facts.gateway_configs, (f"nginx -c {config}: not a file a ```sh block's `tokenmill gateway-config "
                                           f"--format nginx ... > FILE` writes ({sorted(facts.gateway_configs)})")
    arguments = facts.gateway_configs[name]
    assert arguments[arguments.index("--format") + 1] == "nginx", f"{name} is not an nginx config"
    prefix = options.get("-p", "").removeprefix("$PWD/")
    assert prefix in facts.directories or (ROOT / prefix).is_dir(), f"nginx -p {prefix}: no `mkdir` before made it"
    if NGINX is None:
        return  # .ci/run installs nginx: there the config itself is tested
    local = [re.sub(r"(?<=http://)[^:/,]+", "127.0.0.1", argument) for argument in arguments]
    made = subprocess.run([sys.executable, "-m", "tokenmill", "gateway-config", *local], capture_output=True,
                          text=True, timeout=60, env=command_env())
    assert made.returncode == 0, made.stderr
    (scratch / "prefix").mkdir()
    (scratch / name).write_text(made.stdout)
    tested = subprocess.run([NGINX, "-t", "-q", "-p", str(scratch / "prefix"), "-c", str(scratch / name)],
                            capture_output=True, text=True, timeout=60)
    assert tested.returncode == 0, f"nginx -t refuses the config {name}:\n{tested.stdout}{tested.stderr}"


@cache
def services() -> dict[str, set[int]]:
    """Each Service of the manifests and its ports."""
    return {document["metadata"]["name"]: {port["port"] for port in document["spec"]["ports"]}
            for document in manifest_documents() if document.get("kind") == "Service"}


def routes_added(package: Path) -> set[str]:
    return set(re.findall(r"add_route\(\s*[\"']([^\"']+)[\"']", source_text(package)))


def check_curl(text: str, words: list[str], facts: Facts, request: pytest.FixtureRequest, scratch: Path) -> None:
    url = next((word for word in words[1:] if re.match(r"(https?://)?[A-Za-z0-9.-]+(:\d+)?/", word)), None)
    assert url, f"{text}: no URL"
    found = re.match(r"(?P<origin>(?:https?://)?(?P<host>[A-Za-z0-9.-]+)(?::(?P<port>\d+))?)(?P<path>/[^?\s]*)", url)
    assert found, url
    host, port, path = found["host"], found["port"], found["path"]
    if host in ("localhost", "127.0.0.1"):
        if port == str(DOCS_PORT) and facts.launched:
            added = {route for package in facts.packages for route in routes_added(package)}
            if path in added:
                return  # a plugin package installed before adds the route
        else:
            assert port in facts.published, f"{url}: no `docker run -p {port}:...` before publishes it"
    else:
        assert host in services(), f"{url}: {host} is no Service of the manifests ({sorted(services())})"
        assert int(port or 80) in services()[host], f"{url}: the Service {host} has ports {services()[host]}"
    models = {model for arguments in facts.gateway_configs.values()
              for flag, value in zip(arguments, arguments[1:], strict=False) if flag == "--model"
              for model in [value.split("=", 1)[0]]}
    for flag, value in zip(words, words[1:], strict=False):
        if flag == "-H" and value.lower().startswith("x-model:"):
            assert value.split(":", 1)[1].strip() in models, f"{value}: not a model of the gateway's {sorted(models)}"
    server = request.getfixturevalue("docs_server")
    local = text.replace(found["origin"], f"localhost:{server.port}", 1)
    result = subprocess.run(["bash", "-c", PRELUDE + local], cwd=scratch, env=command_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, (f"{text}\n sent to the test's server as {local}\n failed ({result.returncode}):"
                                    f"\n{result.stdout}\n{result.stderr}")


def check_variables(words: list[str], facts: Facts, placeholders_allowed: bool) -> None:
    for index, word in enumerate(words):
        for name in VARIABLE.findall(word):
            if name in facts.variables:
                continue
            as_value = index > 0 and words[index - 1].startswith("-")
            assert placeholders_allowed and as_value and name in PLACEHOLDERS, (
                f"${name} in {' '.join(words)}: no `{name}=...` before sets it")


def check_env_prefix(names: list[str], facts: Facts) -> None:
    tokenmill_source = source_text(ROOT / "core" / "tokenmill")
    for name in names:
        readers = [tokenmill_source, *(source_text(package) for package in facts.packages)]
        assert any(f'"{name}"' in text for text in readers), (
            f"{name}=...: neither tokenmill nor a package installed before reads it")


def learn(words: list[str], facts: Facts) -> None:
    """What the command sets up for the doc's later commands."""
    if not words:
        return
    if words[0] == "mkdir":
        facts.directories.update(word for word in words[1:] if not word.startswith("-"))
    elif words[:2] == ["docker", "build"]:
        facts.images.update(words[i + 1] for i, word in enumerate(words) if word in ("-t", "--tag"))
    elif words[:2] == ["docker", "run"]:
        for i, word in enumerate(words):
            if word == "-p":
                host, _, inside = words[i + 1].rpartition(":")
                facts.published[host.rpartition(":")[2]] = inside
    elif words[:2] == ["pip", "install"]:
        facts.packages.extend(ROOT / word for word in words[2:] if word.startswith("./"))
        facts.tokenmill_without_deps |= "--no-deps" in words and "." in words
    elif words[:3] == ["python", "-m", "venv"]:
        facts.venvs.add(words[3])
    elif words[:2] == ["tokenmill", "launch"]:
        facts.launched = True
    elif words[:2] == ["tokenmill", "gateway-config"] and ">" in words:
        end = words.index(">")
        facts.gateway_configs[words[end + 1]] = words[2:end]


def parts(command: str) -> Iterator[tuple[str, list[str], list[str]]]:
    """Each part of a command joined with ``&&``: its text, its words up to a pipe (``| grep ...`` after it),
    the assignments before them."""
    for part in command.replace("\\\n", " ").split("&&"):
        text = part.strip()
        words = shlex.split(text, comments=True)
        if "|" in words:
            pipe = words.index("|")
            rest = words[pipe + 1:]
            assert rest and rest[0] == "grep" and "|" not in rest, f"{text}: only `| grep ...` may filter output"
            words = words[:pipe]
        index = 0
        while index < len(words) and ASSIGNMENT.match(words[index]):
            index += 1
        yield text, words[:index], words[index:]


def check_command(command: str, facts: Facts | None = None, request: pytest.FixtureRequest | None = None,
                  scratch: Path | None = None) -> None:
    """Check one command by the rule for it, then learn what it sets up."""
    facts = Facts() if facts is None else facts
    if command in ci_commands():
        return
    for text, assignments, words in parts(command):
        if text in ci_commands():
            continue
        check_variables(assignments, facts, placeholders_allowed=False)
        if not words:  # NAME=VALUE: a variable for the later commands
            facts.variables.update(assignment.split("=", 1)[0] for assignment in assignments)
            continue
        check_env_prefix([assignment.split("=", 1)[0] for assignment in assignments], facts)
        if words[0] == "sudo":
            assert words[1:2] == ["chown"], f"{text}: only chown takes sudo"
            words = words[1:]
        venv = words[0].rpartition("/bin/")[0]
        if venv:
            assert venv in facts.venvs, f"{words[0]}: no `python -m venv {venv}` before"
            words = [words[0].rpartition("/")[2], *words[1:]]
        check_variables(words, facts, placeholders_allowed=words[0] == "docker" or words[:2] == ["tokenmill", "launch"])
        if words[:2] == ["pip", "install"]:
            check_pip_install(words, facts)
        elif words[:2] == ["pip", "uninstall"]:
            check_pip_uninstall(words)
        elif words[:2] == ["tokenmill", "launch"]:
            check_launch(words, env=dict(assignment.split("=", 1) for assignment in assignments))
        elif words[:2] == ["tokenmill", "plugins"]:
            assert len(words) == 2, f"{text}: tokenmill plugins takes no arguments"
        elif words[0] == "docker":
            check_docker(words, facts)
        elif words[0] == "kubectl":
            check_kubectl(words)
        elif words[0] in ("mkdir", "chown"):
            check_directories(words, facts)
        elif words[:3] == ["python", "-m", "venv"]:
            assert len(words) == 4, f"{text}: python -m venv DIR"
        elif words[:2] == ["python", "-m"] and re.fullmatch(r"bench(\.\w+)?", words[2]):
            check_bench(words)
        elif words[0] == "nginx":
            assert scratch is not None, "nginx is checked in a block"
            check_nginx(words, facts, scratch)
        elif words[0] == "curl":
            assert request is not None and scratch is not None, "curl is checked in a block"
            check_curl(text, words, facts, request, scratch)
        else:
            pytest.fail(f"no rule checks {text!r}: run it in a ```sh block, or add a rule to tests/doc_rules.py")
        learn(words, facts)


def facts_before(block: Block) -> Facts:
    """What the commands of the blocks of the same doc before ``block`` set up."""
    facts = Facts()
    for earlier in BLOCKS:
        if earlier.path != block.path or earlier.line >= block.line:
            continue
        if earlier.language == "sh":
            for command in commands(earlier):
                for _, assignments, words in parts(command.text):
                    if not words:
                        facts.variables.update(assignment.split("=", 1)[0] for assignment in assignments)
                    venv = words[0].rpartition("/bin/")[0] if words else ""
                    learn([words[0].rpartition("/")[2], *words[1:]] if venv else words, facts)
    return facts
