"""A real server whose tiny random model writes scripted outputs: what a Qwen3-style model writes.

The server runs the tiny random model with a Hermes/Qwen-style chat template (tools shown by the
template, calls written as ``<tool_call>`` blocks, Qwen3's ``enable_thinking`` switch). A random model
writes no calls of its own, so an entry-point plugin's logits processor makes it write a scripted
output, token by token, for requests whose ``seed`` names a script (and then its end-of-sequence
token); other requests run as the model would."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from conftest import RunningServer, start_server

TEMPLATE = textwrap.dedent("""\
    {%- if tools %}<|im_start|>system
    You may call functions. <tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>
    Call one as <tool_call>{"name": <name>, "arguments": <arguments>}</tool_call>.<|im_end|>
    {% endif %}
    {%- for message in messages %}<|im_start|>{{ message.role }}
    {% if message.content %}{{ message.content }}{% endif %}
    {%- if message.tool_calls %}{% for call in message.tool_calls %}<tool_call>
    {{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
    </tool_call>{% endfor %}{% endif %}<|im_end|>
    {% endfor %}
    {%- if add_generation_prompt %}<|im_start|>assistant
    {% if enable_thinking is defined and enable_thinking is false %}<think>

    </think>

    {% endif %}{% endif %}""")

PLUGIN = textwrap.dedent('''
    """Makes the model write a scripted output for a request whose seed names one."""
    import json
    import os

    import torch

    import tokenmill

    with open(os.environ["SCRIPTED_OUTPUTS"]) as file:
        SCRIPTS = json.load(file)
    END = int(os.environ["SCRIPTED_END"])

    @tokenmill.hookimpl
    def tokenmill_logits_processors(parameters):
        script = SCRIPTS.get(str(parameters.get("seed")))
        if script is None:
            return []
        written = []

        def follow(token_ids, scores):
            target = script[len(written)] if len(written) < len(script) else END
            written.append(target)
            forced = torch.full_like(scores, float("-inf"))
            forced[..., target] = 0.0
            return forced

        return [follow]
''')

CALLING, ANSWERING, THINKING_ANSWER, THINKING_JSON = 1, 2, 3, 4
SCRIPTS = {
    CALLING: "<think>\nThe user asks about Paris.\n</think>\n\nLet me check.\n<tool_call>\n"
             '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
    ANSWERING: "It is sunny in Paris, 21 degrees.",
    THINKING_ANSWER: "<think>\nSunny, so say so.\n</think>\n\nIt is sunny in Paris.",
    THINKING_JSON: '<think>\nThe city is Paris {not JSON yet}.\n</think>\n\n{"city": "Paris"}',
}


def start_scripted_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                          args: list[str]) -> RunningServer:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    site = tmp_path_factory.mktemp("site")
    scripts = site / "scripts.json"
    scripts.write_text(json.dumps({str(seed): tokenizer.encode(text, add_special_tokens=False)
                                   for seed, text in SCRIPTS.items()}))
    (site / "scripted_output.py").write_text(PLUGIN)
    dist = site / "scripted_output-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: scripted-output\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[tokenmill]\nscripted = scripted_output\n")
    (site / "template.jinja").write_text(TEMPLATE)
    return start_server(
        ["--model-id", str(tiny_model_dir), "--server", "uvicorn", "--dtype", "float32",
         "--chat-template", str(site / "template.jinja"), *args],
        tmp_path_factory.mktemp("scripted-server"),
        env={"PYTHONPATH": str(site), "TOKENMILL_DISABLE_PLUGIN_AUTOLOAD": "0", "SCRIPTED_OUTPUTS": str(scripts),
             "SCRIPTED_END": str(tokenizer.eos_token_id)})
