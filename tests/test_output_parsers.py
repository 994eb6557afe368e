"""Tool-call and reasoning parsers, on outputs recorded in each family's format (written here from the
formats' public descriptions), read whole and as a stream: token by token with SmolLM2's tokenizer
and character by character, so every marker is also seen split across pieces."""

from __future__ import annotations

import json

import pytest

from tokenmill.http.openai.reading import OutputFormat, OutputReader, choose_chat_format, read_output
from tokenmill.interfaces import FunctionTool
from tokenmill.plugin_manager import build_plugin_manager, choose

WEATHER = FunctionTool("get_weather", "", {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"type": "string"}}})
TIME = FunctionTool("get_time", "", {"type": "object", "properties": {"zone": {"type": "string"}}})
TOOLS = (WEATHER, TIME)
TWO_CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "CET"})]

RECORDED = {
    "hermes": (('I will look both up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
               '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'),
               "I will look both up."),
    "llama3_json": (('{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
                    '{"name": "get_time", "parameters": {"zone": "CET"}}'), ""),
    "mistral": (('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
                '{"name": "get_time", "arguments": {"zone": "CET"}}]'), ""),
    "qwen3_xml": (("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                  "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
                  "<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>"), "Checking."),
    "pythonic": ('[get_weather(city="Paris", days=3), get_time(zone="CET")]', ""),
    "tgi": (('{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
            '{"name": "get_time", "arguments": {"zone": "CET"}}'), ""),
}

OTHER_SPELLINGS = {
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
                   '{"name": "get_time", "parameters": {"zone": "CET"}}',
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}',
    "pythonic": '<|python_start|>[get_weather(city="Paris", days=3), get_time(zone="CET")]<|python_end|>',
    "hermes": '<tool_call>\n{"arguments": {"city": "Paris", "days": 3}, "name": "get_weather"}\n</tool_call>\n'
              '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}</tool_call>',
}


@pytest.fixture(scope="module")
def pm():
    return build_plugin_manager(autoload=False)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def token_pieces(tokenizer, text: str) -> list[str]:
    """``text`` as the pieces a stream sends it in: one per token, as SmolLM2's tokenizer splits it."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, shown = [], ""
    for end in range(1, len(ids) + 1):
        prefix = tokenizer.decode(ids[:end])
        pieces.append(prefix[len(shown):])
        shown = prefix
    assert shown == text
    return pieces


def streamed(output: OutputFormat, pieces: list[str]) -> tuple[str, str, list[tuple[str, str]], set[str]]:
    """What a client puts together from the stream's deltas: reasoning, content, calls and their ids."""
    reader = OutputReader(output)
    reasoning, content, calls, ids = "", "", [], set()
    for number, piece in enumerate(pieces):
        for delta in reader.push(piece, final=number == len(pieces) - 1):
            reasoning += delta.get("reasoning_content", "")
            content += delta.get("content", "")
            for call in delta.get("tool_calls", []):
                if "id" in call:
                    assert call["index"] == len(calls)
                    calls.append((call["function"]["name"], ""))
                    ids.add(call["id"])
                name, arguments = calls[call["index"]]
                calls[call["index"]] = (name, arguments + call["function"]["arguments"])
    return reasoning, content, calls, ids


def decoded(calls) -> list[tuple[str, object]]:
    return [(name, json.loads(arguments)) for name, arguments in calls]


def tools_output(pm, name: str) -> OutputFormat:
    return OutputFormat(TOOLS, choose(pm, "tool_parser", name))


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_each_format_gives_its_calls_whole_and_streamed_in_any_pieces(pm, tokenizer, name):
    text, content = RECORDED[name]
    output = tools_output(pm, name)
    whole = read_output(output, text, final=True)
    assert whole.content == content
    assert decoded((c.name, c.arguments) for c in whole.calls) == TWO_CALLS and whole.finished_calls
    for pieces in (token_pieces(tokenizer, text), list(text)):
        _, streamed_content, calls, ids = streamed(output, pieces)
        assert streamed_content == content
        assert [(n, a) for n, a in calls] == [(c.name, c.arguments) for c in whole.calls]
        assert len(ids) == 2


@pytest.mark.parametrize("name", sorted(OTHER_SPELLINGS))
def test_other_spellings_of_a_format_give_the_same_calls(pm, name):
    whole = read_output(tools_output(pm, name), OTHER_SPELLINGS[name], final=True)
    assert decoded((c.name, c.arguments) for c in whole.calls) == TWO_CALLS
    _, _, calls, _ = streamed(tools_output(pm, name), list(OTHER_SPELLINGS[name]))
    assert decoded(calls) == TWO_CALLS


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_an_answer_in_text_is_content_only(pm, tokenizer, name):
    text = "The weather in Paris is sunny, about 21 degrees [celsius]."
    output = tools_output(pm, name)
    whole = read_output(output, text, final=True)
    assert (whole.content, whole.calls) == (text, ())
    _, content, calls, _ = streamed(output, token_pieces(tokenizer, text))
    assert (content, calls) == (text, [])


def test_a_marker_split_across_tokens_is_held_back_until_it_is_known(pm):
    output = tools_output(pm, "hermes")
    assert read_output(output, "Sure. <tool_", final=False).content == "Sure."
    assert read_output(output, "Sure. <tool_", final=True).content == "Sure. <tool_"
    assert read_output(output, "Sure. <toolbox", final=False).content == "Sure. <toolbox"


def test_a_call_cut_short_keeps_its_arguments_so_far_and_is_not_finished(pm):
    whole = read_output(tools_output(pm, "hermes"), '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
                        final=True)
    (call,) = whole.calls
    assert (call.name, call.arguments, call.complete) == ("get_weather", '{"city": "Pa', False)
    assert not whole.finished_calls


def test_arguments_stream_as_the_model_writes_them(pm, tokenizer):
    text, _ = RECORDED["hermes"]
    reader = OutputReader(tools_output(pm, "hermes"))
    argument_deltas = [call for piece in token_pieces(tokenizer, text) for delta in reader.push(piece, False)
                       for call in delta.get("tool_calls", []) if "id" not in call]
    assert len(argument_deltas) > 4, "arguments come a few characters at a time, not whole at the end"


def test_qwen3_xml_parameters_take_their_schema_types(pm):
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n<parameter=unknown>\n{\"a\": [1]}\n</parameter>\n</function>\n</tool_call>")
    (call,) = read_output(tools_output(pm, "qwen3_xml"), text, final=True).calls
    assert json.loads(call.arguments) == {"city": "42", "days": 3, "unknown": {"a": [1]}}


def test_parallel_tool_calls_false_keeps_the_first_call(pm):
    text, _ = RECORDED["hermes"]
    output = OutputFormat(TOOLS, choose(pm, "tool_parser", "hermes"), parallel=False)
    assert [c.name for c in read_output(output, text, final=True).calls] == ["get_weather"]


REASONING = [
    ("deepseek_r1", True, "The user wants 2+2.\n</think>\n\nIt is 4.", "The user wants 2+2.\n", "It is 4."),
    ("deepseek_r1", True, "<think>\nHmm.\n</think>\n\nIt is 4.", "\nHmm.\n", "It is 4."),
    ("deepseek_r1", True, "Still thinking when the tokens ran out", "Still thinking when the tokens ran out", ""),
    ("qwen3", False, "<think>\nHmm.\n</think>\n\nIt is 4.", "\nHmm.\n", "It is 4."),
    ("qwen3", False, "It is 4.", "", "It is 4."),
    ("qwen3", True, "Hmm.\n</think>\n\nIt is 4.", "Hmm.\n", "It is 4."),
    ("granite", False, "Here is my thought process: add them.\nHere is my response: It is 4.", "add them.", "It is 4."),
    ("granite", False, "It is 4.", "", "It is 4."),
]


@pytest.mark.parametrize("name, first, text, reasoning, content", REASONING)
def test_reasoning_is_split_from_the_answer_whole_and_streamed(pm, tokenizer, name, first, text, reasoning, content):
    output = OutputFormat(reasoning=choose(pm, "reasoning_parser", name), reasoning_first=first)
    whole = read_output(output, text, final=True)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    for pieces in (token_pieces(tokenizer, text), list(text)):
        assert streamed(output, pieces)[:2] == (reasoning, content)


def test_where_the_output_starts_follows_the_prompt(pm):
    deepseek, qwen3 = choose(pm, "reasoning_parser", "deepseek_r1"), choose(pm, "reasoning_parser", "qwen3")
    opened, closed = "<|im_start|>assistant\n<think>\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert deepseek.starts_reasoning(opened) and qwen3.starts_reasoning(opened)
    assert not deepseek.starts_reasoning(closed) and not qwen3.starts_reasoning(closed)
    plain = "<|im_start|>assistant\n"
    assert deepseek.starts_reasoning(plain) and not qwen3.starts_reasoning(plain)


def test_tool_calls_are_read_from_the_answer_after_the_reasoning(pm, tokenizer):
    text = ("<think>\nI could call <tool_call> here.\n</think>\n\nOn it.\n<tool_call>\n"
            '{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
    output = OutputFormat(TOOLS, choose(pm, "tool_parser", "hermes"), choose(pm, "reasoning_parser", "qwen3"))
    whole = read_output(output, text, final=True)
    assert whole.reasoning == "\nI could call <tool_call> here.\n" and whole.content == "On it."
    assert decoded((c.name, c.arguments) for c in whole.calls) == [("get_time", {"zone": "CET"})]
    reasoning, content, calls, _ = streamed(output, token_pieces(tokenizer, text))
    assert (reasoning, content, decoded(calls)) == (whole.reasoning, "On it.", [("get_time", {"zone": "CET"})])


class Templated:
    def __init__(self, template: str) -> None:
        self.chat_template = template


@pytest.mark.parametrize("template, parser", [
    ("{{ '<tool_call>' }}{{ tools | tojson }}", "hermes"),
    ("<tool_call><function={{ name }}><parameter=", "qwen3_xml"),
    ("{{ '[TOOL_CALLS]' }}", "mistral"),
    ("{{ '<|python_tag|>' }}", "llama3_json"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "tgi"),
])
def test_the_template_picks_the_parser_when_no_flag_names_one(pm, template, parser):
    assert choose_chat_format(pm, None, None, Templated(template)).tool_parser.name == parser
    assert choose_chat_format(pm, "pythonic", None, Templated(template)).tool_parser.name == "pythonic"


def test_an_unknown_parser_name_lists_the_choices(pm):
    from tokenmill.plugin_manager import PluginError

    with pytest.raises(PluginError, match=r"unknown --tool-call-parser 'hermes2' \(choices: hermes, llama3_json"):
        choose_chat_format(pm, "hermes2", None, Templated(""))
    with pytest.raises(PluginError, match=r"unknown --reasoning-parser 'r1' \(choices: deepseek_r1, granite, qwen3"):
        choose_chat_format(pm, None, "r1", Templated(""))


def accepts_whole(grammar, tokenizer, text: str) -> bool:
    """Whether ``text`` may end the output under ``grammar`` (a GrammarError if it breaks it on the way)."""
    matcher = grammar.new_matcher()
    for token in tokenizer.encode(text, add_special_tokens=False):
        matcher.accept(token)
    return matcher.matcher.is_accepting()


def test_a_grammar_after_free_text_holds_only_what_follows_the_end_marker(tokenizer):
    from tokenmill.sampling.grammar import GrammarCompiler, GrammarError

    compiler = GrammarCompiler(tokenizer, len(tokenizer))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    for inner in (compiler.json_schema(schema), compiler.regex("(yes|no)"), compiler.lark('start: "ok"')):
        after = compiler.after_free_text(inner, "</think>")
        answer = {"json": '{"a": 1}', "regex": "yes", "lark": "ok"}[inner.kind]
        assert accepts_whole(after, tokenizer, "Thinking {not an answer} here.\n</think>\n\n" + answer)
        assert not accepts_whole(after, tokenizer, "Still thinking " + answer), "no answer before the thinking ends"
        with pytest.raises(GrammarError):
            accepts_whole(after, tokenizer, "Done.</think>\nsomething else")


def test_a_parser_that_raises_leaves_the_output_as_text(pm, caplog):
    """A third-party parser's bug must not end the response: what it could not read is answered as text."""

    class Broken:
        name = "broken"

        def parse(self, text, tools, final):
            raise ValueError("a bug in a plugin")

    reader = OutputReader(OutputFormat(TOOLS, Broken()))  # type: ignore[arg-type]
    deltas = reader.push("Hello", final=False) + reader.push(" there", final=True)
    assert "".join(delta.get("content", "") for delta in deltas) == "Hello there"
    assert read_output(OutputFormat(TOOLS, Broken()), "text", final=True).content == "text"  # type: ignore[arg-type]
    assert "the broken tool parser failed" in caplog.text
