"""The chat template the server renders with when the operator replaces the model's.

Two flags do it, as the servers they come from take them: vLLM's ``--chat-template`` (a Jinja
template, or the path of a file holding one) and TGI's ``--tokenizer-config-path`` (a
``tokenizer_config.json`` whose ``chat_template`` is used). The template is read and compiled
before the weights load, so a missing file or broken Jinja stops the start at once with one line,
and it is set on the tokenizer the chat routes render with.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenmill.model.loading import ModelLoadError

ChatTemplate = str | dict[str, str]
"""One template, or named ones (``default``, ``tool_use``...) as a tokenizer_config.json may hold."""


def read_chat_template(config: Any) -> ChatTemplate | None:
    """The template ``config`` asks for, compiled once as a check; None: keep the model's own."""
    literal_or_path = getattr(config, "chat_template", None)
    tokenizer_config = getattr(config, "tokenizer_config_path", None)
    if literal_or_path and tokenizer_config:
        raise ModelLoadError("--chat-template and --tokenizer-config-path both set the chat template: pass one")
    if literal_or_path:
        template: ChatTemplate = _template_text(literal_or_path)
        flag = "--chat-template"
    elif tokenizer_config:
        template = _template_of_tokenizer_config(tokenizer_config)
        flag = f"--tokenizer-config-path {tokenizer_config}"
    else:
        return None
    for name, text in (template.items() if isinstance(template, dict) else [("", template)]):
        _check_compiles(text, flag + (f" (template {name!r})" if name else ""))
    return template


def use_chat_template(tokenizer: Any, template: ChatTemplate | None) -> None:
    """Make ``tokenizer`` render chats with ``template`` (nothing changes for None)."""
    if template is not None:
        tokenizer.chat_template = template


def _template_text(value: str) -> str:
    """vLLM's rule: an existing file is read; text with Jinja in it is the template itself."""
    path = Path(value).expanduser()
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ModelLoadError(f"--chat-template: cannot read {path}: {error}") from None
    except ValueError:  # a path too long or with a NUL byte: it is template text
        pass
    if "{{" in value or "{%" in value:
        return value
    raise ModelLoadError(f"--chat-template: no such file {value!r}, and it is not a Jinja template either "
                         "(no {{ or {%)")


def _template_of_tokenizer_config(path_text: str) -> ChatTemplate:
    path = Path(path_text).expanduser()
    flag = f"--tokenizer-config-path {path_text}"
    try:
        tokenizer_config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{flag}: no such file") from None
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ModelLoadError(f"{flag}: not a readable JSON file: {error}") from None
    template = tokenizer_config.get("chat_template") if isinstance(tokenizer_config, dict) else None
    if isinstance(template, str) and template:
        return template
    if isinstance(template, list) and template and all(
            isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
            for t in template):
        return {t["name"]: t["template"] for t in template}  # the named form tokenizer_config.json uses
    raise ModelLoadError(f"{flag}: it has no `chat_template` (a string, or a list of "
                         '{"name": ..., "template": ...})')


def _check_compiles(text: str, flag: str) -> None:
    """Compile ``text`` in the environment transformers renders chat templates with."""
    import jinja2

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template as compile_template
    except ImportError:  # another transformers: its sandbox without its extensions
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        compile_template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string
    try:
        compile_template(text)
    except jinja2.TemplateSyntaxError as error:
        raise ModelLoadError(f"{flag}: the Jinja template does not compile: {error.message} "
                             f"(line {error.lineno})") from None
