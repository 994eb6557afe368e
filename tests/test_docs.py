"""Every command the docs show is run, or checked where it cannot run here.

The docs: every ``*.md`` of the repository (README.md, docs/, hooks.md, bench/, image/, the plugin packages'
and the test packages' READMEs), but for hidden folders, build output and ``bench/results``/``bench/out``.
The convention, by a fenced block's info string (docs/architecture.md#commands-in-the-docs says the same):

* ```` ```sh ````: run as is with bash (``set -euo pipefail``; ``curl`` fails on an HTTP error), in a scratch
  directory, against one server this module starts on a tiny random model serving one LoRA adapter,
  ``support``. The server listens on 3000, the docs' port, when it is free, else on another port, with
  ``localhost:3000`` rewritten in the commands. A comment right after a command that starts with ``# {``,
  ``# [`` or ``# data: `` is the shape of what the command prints, one JSON line per non-empty output
  line: the same keys, value types and list lengths (the values are examples; the text is the model's).
* ```` ```console ````: a terminal session, run the same way but without ``set -e``: a line ``$ COMMAND``
  is a command, the lines up to the next ``$ `` line what it prints (stdout and stderr together), compared
  exactly. A command may fail; one that does must be followed by ``$ echo $?`` and the status it shows,
  so that the exit status is checked too.
* ```` ```sh check ````: commands that install, start a server or need a cluster, checked without running,
  each by a rule (what a doc's earlier commands set up, in any block, counts: a variable, a directory, an
  image, a published port, an installed package, a venv):

  - the README's test command must be a line of ``.ci/run``; any command ``.ci/run`` runs counts as run;
  - ``tokenmill launch ARGS`` must parse with tokenmill's own parser (``tokenmill.config.parse_config``);
    ``tokenmill plugins`` takes no arguments; ``| grep ...`` may filter a command's output;
  - ``pip install`` may name only this checkout (and its extras), a plugin package in it, a package and pin
    that ``.ci/run`` or ``bench.peers.SETUP_STEPS`` installs, or, unpinned, tokenmill's own requirements
    (after ``pip install --no-deps .``: all of them but those vLLM provides, ``bench.peers.VLLM_OWNED``);
    ``pip uninstall`` must be a step of ``bench.peers.SETUP_STEPS``; ``python -m venv DIR`` makes a venv
    whose ``DIR/bin/COMMAND`` is then checked as ``COMMAND``;
  - ``docker build`` must name a Dockerfile target; ``docker run`` an image built before, the image's port
    (or the ``-e PORT=`` it sets) and its ``/data`` volume, and flags that parse; ``docker push`` an image
    built before;
  - ``kubectl apply -f`` manifests that tests/test_image.py validates; ``kubectl create secret generic NAME
    --from-literal=KEY=...`` a secret and key that those manifests read;
  - ``NAME=VALUE`` alone sets a variable; before a command, a variable tokenmill or a package installed
    before reads; ``mkdir -p DIR`` makes a directory; ``[sudo] chown UID:GID DIR`` must give a directory
    made before to the image's user (the Dockerfile's ``USER``). A ``$NAME`` must have been set, but for a
    placeholder the reader fills in (``$volume``, ``$model``: TGI's README's) as a flag value or a ``-v``
    source of ``docker run`` or ``tokenmill launch``;
  - ``python -m bench [NAME] ARGS`` and ``python -m bench.MODULE ARGS`` must parse with that scenario's or
    module's own ``parser()`` (``bench.compare``'s reads the scenario name among them), a ``--from-json``
    file must exist;
  - ``nginx -p PREFIX -c FILE``: FILE is what a ```` ```sh ```` block of the doc writes with ``tokenmill
    gateway-config --format nginx ... > FILE``, PREFIX a directory made before; where nginx is installed
    (``.ci/run`` installs it), ``nginx -t`` accepts that config (its upstream hosts as 127.0.0.1);
  - ``curl`` to a server the block cannot start here (a port a ``docker run -p`` published, a Service of the
    manifests, ``localhost:3000`` after a ``tokenmill launch``) is sent to this module's server instead and
    must succeed: the route exists and the body validates (an ``x-model`` header must name a model of the
    doc's ``gateway-config``); a route a plugin package installed before adds (``add_route``) is taken as is.
* ```` ```python ````: run as a script (against the same server); one that talks to the server must print.
* any other fence (``toml``, one without an info string) is text (flags to paste elsewhere, a config
  fragment), not a command: none of its lines may start with a command (``curl``, ``tokenmill``,
  ``python``, ``pip``, ``docker``, ``kubectl``, ``nginx``, ...), so that no command hides from the rules.

Prose that names a benchmark in passing (``python -m bench NAME`` or ``python -m bench.MODULE``) must name a
scenario of bench/cli.py's table or a module of bench/, and its flags must be that one's (with its values,
when the span shows no ``...``, they must parse).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import RunningServer, free_port, tiny_llama_config
from doc_blocks import (
    BLOCKS,
    CHECK_BLOCKS,
    CI_RUN,
    COMMAND_LANGUAGES,
    CONSOLE_BLOCKS,
    DOC_FILES,
    DOCS_PORT,
    PYTHON_BLOCKS,
    ROOT,
    RUN_BLOCKS,
    SHELL_LANGUAGES,
    Block,
    Command,
    anchor,
    bench_spans,
    check_shapes,
    commands,
    console_session,
    hidden_command,
    shape_mismatch,
)
from doc_rules import PRELUDE, Facts, bench_parser, check_command, command_env, facts_before, run_parser

from bench import cli

MARK = "@@tokenmill-docs-command-done@@"


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def write_small_adapter(target: Path, rank: int = 4) -> Path:
    """A PEFT LoRA checkpoint on the tiny model's q and v projections, written without peft (whose import
    alone would cost this module seconds)."""
    import torch
    from safetensors.torch import save_file

    config = tiny_llama_config()
    kv_width = config.num_key_value_heads * config.head_dim
    generator = torch.Generator().manual_seed(3)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, out_features in (("q_proj", config.num_attention_heads * config.head_dim), ("v_proj", kv_width)):
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, config.hidden_size, generator=generator) * 0.2
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.2
    target.mkdir(parents=True)
    save_file(tensors, str(target / "adapter_model.safetensors"))
    (target / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"],
         "bias": "none"}))
    return target


@pytest.fixture(scope="module")
def docs_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """The tiny model behind ``tokenmill launch``, with the adapter ``support`` the docs ask for."""
    root = tmp_path_factory.mktemp("docs-server")
    adapter = write_small_adapter(root / "support")
    port = DOCS_PORT if port_is_free(DOCS_PORT) else free_port()
    log_path = root / "server.log"
    env = {**os.environ, "TOKENMILL_DISABLE_PLUGIN_AUTOLOAD": "1", "COMPILE_MODEL": "false"}
    command = [sys.executable, "-m", "tokenmill", "launch", "--hostname", "127.0.0.1", "--port", str(port),
               "--model-id", str(tiny_model_dir), "--server", "uvicorn", "--dtype", "float32",
               "--max-total-tokens", "1024", "--lora-adapters", f"support={adapter}"]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = RunningServer(process, port, log_path)
    deadline = time.monotonic() + 120
    try:
        while True:
            assert process.poll() is None, f"server exited with {process.returncode}:\n{server.log()}"
            assert time.monotonic() < deadline, f"server not healthy after 120 s:\n{server.log()}"
            try:
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield server
    finally:
        server.stop()


def for_server(text: str, server: RunningServer) -> str:
    return text if server.port == DOCS_PORT else text.replace(f"localhost:{DOCS_PORT}", f"localhost:{server.port}")


def test_the_shape_check_sees_keys_types_and_lengths() -> None:
    shown = {"a": [{"id": 1, "text": "x"}], "b": None, "c": 0.5}
    assert shape_mismatch(shown, {"a": [{"id": 7, "text": "y"}], "b": None, "c": -2}) is None
    assert "keys" in shape_mismatch(shown, {"a": [], "b": None})
    assert "list of 1" in shape_mismatch(shown, {"a": [], "b": None, "c": 1.0})
    assert "NoneType expected" in shape_mismatch(shown, {"a": [{"id": 1, "text": "x"}], "b": "text", "c": 1})
    assert "str expected" in shape_mismatch(shown, {"a": [{"id": 1, "text": 3}], "b": None, "c": 1})


def test_commands_continue_over_lines_and_keep_the_comments_after_them() -> None:
    block = Block(ROOT / "README.md", 1, "sh", (), "# a title\ncurl -s x \\\n  -d '{\"a\":\n 1}'\n# {\"a\": 1}\n"
                  "\n# another\necho hi\n# not a shape\n")
    assert commands(block) == [Command("curl -s x \\\n  -d '{\"a\":\n 1}'", ['{"a": 1}']), Command("echo hi", [])]


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=lambda block: block.where)
def test_each_shell_block_runs_and_prints_the_shapes_it_shows(block: Block, docs_server: RunningServer,
                                                                 tmp_path: Path) -> None:
    found = commands(block)
    assert found, f"{block.where}: a sh block without a command"
    script = PRELUDE + "".join(f"{for_server(c.text, docs_server)}\necho {MARK}\n" for c in found)
    result = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=command_env(), capture_output=True,
                            text=True, timeout=120)
    outputs = result.stdout.split(f"{MARK}\n")
    assert result.returncode == 0, (f"{block.where}: command {len(outputs)} of {len(found)} failed "
                                    f"({result.returncode}):\n{found[len(outputs) - 1].text}\n"
                                    f"stdout:\n{outputs[-1]}\nstderr:\n{result.stderr}")
    for command, output in zip(found, outputs, strict=False):
        if command.shapes:
            check_shapes(command, output, f"{block.where}: {command.text.splitlines()[0]}")


def talks_to_the_server(text: str) -> bool:
    return f"localhost:{DOCS_PORT}" in text


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda block: block.where)
def test_each_python_block_runs_against_the_server(block: Block, request: pytest.FixtureRequest,
                                                   tmp_path: Path) -> None:
    text = block.text
    if talks_to_the_server(text):
        text = for_server(text, request.getfixturevalue("docs_server"))
    result = subprocess.run([sys.executable, "-c", text], cwd=tmp_path, env=command_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, f"{block.where}:\n{result.stdout}\n{result.stderr}"
    if talks_to_the_server(block.text):  # a fragment of a plugin module (hooks.md) defines, and prints nothing
        assert result.stdout.strip(), f"{block.where} printed nothing"


@pytest.mark.parametrize("block", CONSOLE_BLOCKS, ids=lambda block: block.where)
def test_each_console_block_prints_what_it_shows_and_fails_as_it_says(block: Block, request: pytest.FixtureRequest,
                                                                       tmp_path: Path) -> None:
    session = console_session(block)
    assert session, f"{block.where}: a console block without a `$ ` command"
    server = request.getfixturevalue("docs_server") if talks_to_the_server(block.text) else None
    script = PRELUDE.replace("set -euo pipefail\n", "") + "".join(
        f"{for_server(command, server) if server else command} 2>&1\n"
        f"__status=$?; echo; echo \"{MARK} $__status\"; (exit $__status)\n" for command, _ in session)
    result = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=command_env(), capture_output=True,
                            text=True, timeout=120)
    pieces = result.stdout.split(f"\n{MARK} ")
    outputs, statuses = [pieces[0]], []
    for piece in pieces[1:]:
        status, _, rest = piece.partition("\n")
        statuses.append(int(status))
        outputs.append(rest)
    assert len(statuses) == len(session), f"{block.where}: the session stopped early:\n{result.stdout}{result.stderr}"
    for index, ((command, shown), printed, status) in enumerate(zip(session, outputs, statuses, strict=False)):
        printed_lines = printed.rstrip("\n").splitlines() if printed.strip() else []
        assert [line.rstrip() for line in printed_lines] == [line.rstrip() for line in shown], (
            f"{block.where}: `$ {command}` printed (status {status}):\n{printed}\nthe doc shows:\n" + "\n".join(shown))
        if status != 0:
            following = session[index + 1][0] if index + 1 < len(session) else None
            assert following == "echo $?", (f"{block.where}: `$ {command}` exits with {status}: show it with "
                                            "`$ echo $?` right after")


@pytest.mark.parametrize("block", CHECK_BLOCKS, ids=lambda block: block.where)
def test_each_checked_block_names_what_exists_and_parses(block: Block, request: pytest.FixtureRequest,
                                                          tmp_path: Path) -> None:
    found = commands(block)
    assert found, f"{block.where}: a sh check block without a command"
    facts = facts_before(block)
    for number, command in enumerate(found):
        scratch = tmp_path / str(number)
        scratch.mkdir()
        try:
            check_command(command.text, facts, request, scratch)
        except AssertionError as error:
            raise AssertionError(f"{block.where}: {error}") from None


def test_the_readme_test_command_is_the_one_ci_runs() -> None:
    (test_command,) = [c.text for block in CHECK_BLOCKS if block.path == ROOT / "README.md"
                       for c in commands(block) if "python -m pytest" in c.text]
    assert test_command in CI_RUN.read_text().splitlines()


def test_the_check_rules_refuse_what_does_not_exist(tmp_path: Path) -> None:
    built = Facts(images={"tokenmill:cuda"})
    for wrong, facts in (
            ("tokenmill launch --no-such-flag 1", None), ("pip install -e '.[nonesuch]'", None),
            ("pip install torch==1.0", None), ("pip install nonesuch", None), ("pip uninstall -y torch", None),
            ("docker build --target nonesuch .", None), ("docker push elsewhere:tag", built),
            ("docker run -p 8080:8080 tokenmill:cuda", built), ("docker run -p 8080:80 other:tag", built),
            ("kubectl apply -f image/k8s/nonesuch.yaml", None),
            ("kubectl create secret generic tokenmill --from-literal=nonesuch=x", None),
            ("mkdir -p $nowhere", None), ("chown 0:0 data", Facts(directories={"data"})),
            ("chown 1000:1000 elsewhere", None), ("venv/bin/pip install .", None),
            ("NONESUCH_SETTING=1 tokenmill launch", None), ("tokenmill plugins --all", None),
            ("python -m bench quick --no-such-flag", None), ("python -m bench latency --batch-size x", None),
            ("python -m bench.limit", None), ("python -m bench.nonesuch", None),
            ("python -m bench --from-json bench/results/nonesuch.json", None),
            ("nginx -p gateway -c nginx.conf", Facts(directories={"gateway"})),
            ("tokenmill plugins | sort", None), ("something-else --flag", None)):
        with pytest.raises((AssertionError, SystemExit, pytest.fail.Exception)):
            check_command(wrong, facts, scratch=tmp_path)


def test_the_check_rules_take_what_the_docs_show() -> None:
    facts = Facts()
    for command in ("volume=$PWD/data", 'mkdir -p "$volume" && sudo chown 1000:1000 "$volume"',
                    "docker build --target cuda -t tokenmill:cuda .",
                    'docker run -e PORT=8080 -p 8080:8080 -v "$volume":/data tokenmill:cuda --model-id $model',
                    "python -m venv venv", "venv/bin/pip install --no-deps . ./plugins/packages/tokenmill-vllm",
                    "venv/bin/tokenmill plugins | grep vllm",
                    "python -m bench latency --backend paged --batch-size 1 2",
                    "python -m bench full --systems naive-transformers"):
        check_command(command, facts)
    assert facts.variables >= {"volume"} and facts.images == {"tokenmill:cuda"} and facts.published == {"8080": "8080"}


def test_the_docs_are_every_markdown_file_of_the_repository() -> None:
    names = {path.relative_to(ROOT).as_posix() for path in DOC_FILES}
    assert names >= {"README.md", "hooks.md", "docs/configuration.md", "docs/architecture.md", "bench/README.md",
                     "bench/RESULTS.md", "image/README.md", "image/k8s/README.md", "image/gateway/README.md",
                     "plugins/packages/tokenmill-example/README.md", "plugins/packages/tokenmill-vllm/README.md",
                     "tests/packages/tokenmill-faults/README.md"}, names
    assert not any(name.startswith((".", "bench/results/")) for name in names), names


def test_every_shell_block_follows_the_convention_and_the_readme_stays_short() -> None:
    allowed = {("sh", ()), ("sh", ("check",)), ("console", ())}
    odd = [block.where for block in BLOCKS
           if block.language in SHELL_LANGUAGES and (block.language, block.tags) not in allowed]
    assert not odd, f"shell blocks are ```sh (run), ```sh check (checked) or ```console (run, output compared): {odd}"
    assert RUN_BLOCKS and CHECK_BLOCKS and CONSOLE_BLOCKS and PYTHON_BLOCKS
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_no_command_hides_in_a_text_fence() -> None:
    hidden = [f"{block.where}: {line.strip()}" for block in BLOCKS if block.language not in COMMAND_LANGUAGES
              for line in block.text.splitlines() if hidden_command(line)]
    assert not hidden, f"commands under a text fence: give them ```sh, ```sh check or ```console: {hidden}"


def test_a_command_in_a_text_fence_is_seen() -> None:
    assert hidden_command("curl localhost:3000/health") == "curl"
    assert hidden_command("$ TOKEN=1 venv/bin/tokenmill launch") == "tokenmill"
    assert hidden_command("  python -m bench full") == "python"
    assert hidden_command('my_plugin = "my_package.plugin"') is None
    assert hidden_command("--total-queued-requests-metric tgi_queue_size") is None


PLACEHOLDER = re.compile(r"<|[A-Z][A-Z0-9_]*(\.\w+)?$")
"""A value the reader fills in, in a usage line: ``N``, ``DIR``, ``RUN.json``, ``<old kernel>``."""


def test_the_benchmarks_the_prose_names_exist_with_their_flags() -> None:

    named = {match for path in DOC_FILES for match in re.findall(r"python -m bench([. ][a-z_]+)", path.read_text())}
    assert named
    for name in named:
        if name.startswith("."):
            assert (ROOT / "bench" / f"{name[1:]}.py").is_file(), f"python -m bench{name}: no such module"
        else:
            assert name.strip() in cli.SCENARIO_MODULES, f"python -m bench{name}: not a scenario of bench/cli.py"
    spans = bench_spans()
    assert spans
    wrong = []
    for path, span in spans:
        words = [word.strip("[]") for word in span.split()]
        words = [word for word in words if word]
        if re.search(r"[A-Z]", words[2]) or (len(words) > 3 and words[3].isupper()):
            continue  # python -m bench.MODULE, python -m bench NAME: placeholders
        try:
            command_line, args = bench_parser(words)
            if not args:
                continue  # the name alone, checked above
            if any(word == "..." or PLACEHOLDER.match(word) for word in args):  # usage: the flags must be its own
                unknown = [word for word in args if word.startswith("-")
                           and word not in command_line._option_string_actions]
                assert not unknown, f"no such flags {unknown}"
            else:
                run_parser(command_line, args, span)
        except AssertionError as error:
            wrong.append(f"{path.relative_to(ROOT)}: `{span}`: {error}")
    assert not wrong, wrong


def test_every_relative_link_reaches_a_file_and_its_heading() -> None:
    broken = []
    for path in DOC_FILES:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, fragment = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
            elif fragment and linked.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", linked.read_text(), re.MULTILINE)
                if fragment not in {anchor(heading) for heading in headings}:
                    broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken
