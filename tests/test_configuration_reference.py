"""docs/configuration.md's flag reference is generated from the parser of `tokenmill launch`, and it says enough."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
from conftest import ci_script

from tokenmill.config import build_parser, env_name
from tokenmill.config.launcher import LAUNCHER_FLAGS, SAGEMAKER_VARIABLES

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / ".ci" / "configuration_reference.py"
PAGE = ROOT / "docs" / "configuration.md"


@pytest.fixture(scope="module")
def script() -> types.ModuleType:
    return ci_script(SCRIPT)


def parser_flags() -> list[argparse.Action]:
    """Every flag `tokenmill launch` knows, --help left out."""
    return [action for action in build_parser(env={})._actions
            if action.option_strings and not isinstance(action, argparse._HelpAction)]


def reference_rows(text: str) -> dict[str, str]:
    """The reference's table rows, by the first flag name in each."""
    block = text[text.index("<!-- flag reference"):]
    rows = {}
    for line in block.splitlines():
        match = re.match(r"\| `(-[-\w]+)`", line)
        if match:
            rows[match.group(1)] = line
    return rows


def hand_written(text: str) -> str:
    return text[:text.index("<!-- flag reference")]


def test_the_flag_reference_in_docs_configuration_md_matches_the_parser(script) -> None:
    diff = script.stale_diff(PAGE.read_text())
    assert not diff, f"docs/configuration.md is stale; run python .ci/configuration_reference.py\n{diff}"


def test_the_check_command_passes_on_the_page_and_fails_with_a_diff_on_a_stale_copy(tmp_path) -> None:
    assert subprocess.run([sys.executable, str(SCRIPT), "--check"], check=False, cwd=ROOT).returncode == 0
    stale = tmp_path / "configuration.md"
    text = PAGE.read_text()
    assert "| `--max-total-tokens` | `MAX_TOTAL_TOKENS` |" in text
    stale.write_text(text.replace("| `--max-total-tokens` | `MAX_TOTAL_TOKENS` |", "| `--max-total-tokens` | `MTT` |"))
    result = subprocess.run([sys.executable, str(SCRIPT), "--check", "--path", str(stale)],
                            check=False, capture_output=True, text=True)
    assert result.returncode == 1
    assert "the flag reference is stale; run python .ci/configuration_reference.py" in result.stderr
    assert "-| `--max-total-tokens` | `MTT` |" in result.stderr
    assert "+| `--max-total-tokens` | `MAX_TOTAL_TOKENS` |" in result.stderr


def test_a_flag_added_to_the_parser_changes_the_reference(script) -> None:
    parser = build_parser(env={})
    before = script.reference_block(parser)
    parser.add_argument("--new-setting", type=int, default=7, help="a setting added later [env NEW_SETTING]")
    row = reference_rows(script.reference_block(parser))["--new-setting"]
    assert row == "| `--new-setting` | `NEW_SETTING` | integer | `7` | a setting added later |"
    assert "--new-setting" not in before


def test_generating_rewrites_only_the_block_between_the_markers(script, tmp_path) -> None:
    page = tmp_path / "configuration.md"
    page.write_text(f"# Prose\n\nby hand\n\n{script.BEGIN}\nstale table\n{script.END}\n\nafter\n")
    assert script.main(["--path", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("# Prose\n\nby hand\n\n") and text.endswith(f"{script.END}\n\nafter\n")
    assert "stale table" not in text and script.stale_diff(text) == ""
    page.write_text("no markers\n")
    with pytest.raises(ValueError, match="docs/configuration.md lacks the markers"):
        script.main(["--path", str(page)])


@pytest.mark.parametrize("action", parser_flags(), ids=lambda action: action.option_strings[0])
def test_every_flag_the_parser_knows_is_in_the_reference_with_its_variable_and_default(action, script) -> None:
    row = reference_rows(PAGE.read_text()).get(action.option_strings[0])
    assert row, f"{action.option_strings[0]} is not in docs/configuration.md"
    cells = [cell.strip() for cell in row.strip("|").split(" | ")]
    assert cells[0] == ", ".join(f"`{name}`" for name in action.option_strings)
    tgi = {flag.name: flag for flag in LAUNCHER_FLAGS}
    reads_variable = action.dest not in tgi or tgi[action.dest].environment
    assert cells[1] == (f"`{env_name(action.dest)}`" if reads_variable else "none")
    assert cells[3] == script.default_text(action)


def test_each_flag_reads_the_variable_the_reference_gives_it() -> None:
    assert env_name("max_total_tokens") == "MAX_TOTAL_TOKENS"
    for action in parser_flags():
        name = env_name(action.dest)
        if action.dest in {flag.name for flag in LAUNCHER_FLAGS}:
            continue
        assert (action.help or "").endswith(f"[env {name}]"), f"{action.option_strings[0]}: --help names another"
    assert build_parser(env={"PORT": "8123"}).parse_args([]).port == 8123
    assert build_parser(env={"MAX_TOTAL_TOKENS": "77"}).parse_args([]).max_total_tokens == 77
    assert build_parser(env={"CUDA_GRAPHS": "1,2"}).parse_args([]).cuda_graphs == "1,2"
    assert build_parser(env={"ENV": "true"}).parse_args([]).env is False  # the one flag without a variable


@pytest.mark.parametrize("action", parser_flags(), ids=lambda action: action.option_strings[0])
def test_every_flag_says_what_it_does_and_what_unset_means(action, script) -> None:
    text = script.meaning(action)
    assert text.strip(), f"{action.option_strings[0]} has no help text"
    assert "|" not in text, f"{action.option_strings[0]}: a help text with | breaks the table"
    if action.default is None and action.dest not in {flag.name for flag in LAUNCHER_FLAGS}:
        assert "default" in text, f"{action.option_strings[0]} is unset by default and does not say what that means"


def test_the_reference_groups_tokenmills_flags_then_tgis_launcher_flags_then_sagemakers_variables(script) -> None:
    block = script.reference_block()
    headings = [line for line in block.splitlines() if line.startswith("### ")]
    assert headings == ["### tokenmill's flags",
                        "### TGI launcher flags accepted without effect (each logs a warning)",
                        "### SageMaker variables"]
    rows = reference_rows(block)
    assert list(rows)[:3] == ["--model-id", "--revision", "--huggingface-hub-cache"]
    assert rows["--port"].startswith("| `--port`, `-p` | `PORT` | integer | `3000` |")
    assert rows["--prefix-caching"].startswith(
        "| `--prefix-caching`, `--no-prefix-caching` | `PREFIX_CACHING` | switch; variable: a boolean | on |")
    assert rows["--lora-adapter-dir"].startswith(
        "| `--lora-adapter-dir` | `LORA_ADAPTER_DIR` | text; repeatable; variable: a `:`-separated list | none |")
    assert rows["--env"].startswith("| `--env`, `-e` | none | switch | off |")
    flags = {name for action in parser_flags() for name in action.option_strings}
    for source, target in SAGEMAKER_VARIABLES:
        flag = "--" + target.lower().replace("_", "-")
        assert f"| `{source}` | `{target}` | `{flag}` |" in block and flag in flags


def test_the_prose_says_how_flags_and_variables_relate_and_how_a_contradiction_fails() -> None:
    prose = hand_written(PAGE.read_text())
    for words in ("`--max-total-tokens` reads `MAX_TOTAL_TOKENS`", "`--port` reads `PORT`", "the first of these wins",
                  "one line on stderr and exit status 2", "tokenmill: error:", "HF_API_TOKEN", "SM_NUM_GPUS=0"):
        assert words in prose, words
    without_variable = [action.option_strings[0] for action in parser_flags()
                        if action.dest in {flag.name for flag in LAUNCHER_FLAGS if not flag.environment}]
    assert without_variable == ["--env"] and "Only `--env` (TGI's, without effect) reads none" in prose


def environment_variables_read_in_core() -> set[str]:
    """Names that core/tokenmill reads from os.environ literally (flags' variables are read by name)."""
    pattern = re.compile(r'os\.environ(?:\.get\(|\[)\s*"([A-Z][A-Z0-9_]+)"'
                         r'|"([A-Z][A-Z0-9_]+)"\s+(?:not\s+)?in\s+os\.environ')
    found = set()
    for path in (ROOT / "core" / "tokenmill").rglob("*.py"):
        for match in pattern.finditer(path.read_text()):
            found.add(match.group(1) or match.group(2))
    serve = (ROOT / "core" / "tokenmill" / "http" / "serve.py").read_text()
    found |= set(re.findall(r'ARGS_VARIABLE = "([A-Z_]+)"', serve))
    return found


def test_every_environment_variable_tokenmill_reads_is_on_the_page() -> None:
    text = PAGE.read_text()
    flag_variables = {env_name(action.dest) for action in parser_flags()}
    read = environment_variables_read_in_core()
    assert {"TOKENMILL_CACHE_DIR", "TOKENMILL_DISABLE_PLUGIN_AUTOLOAD", "TOKENMILL_PLUGINS"} <= read
    missing = sorted(name for name in read - flag_variables if f"`{name}`" not in hand_written(text))
    assert not missing, f"docs/configuration.md does not say what these variables do: {missing}"
    for name in ("LOG_LEVEL", "LOG_FORMAT", "HF_TOKEN", "HF_HUB_OFFLINE"):
        assert f"| `{name}` |" in text
