"""Chat prompts, tool-call rules and stop handling of the OpenAI routes, without a server."""

from __future__ import annotations

import copy
import json
import random
import re
from types import SimpleNamespace

import jsonschema
import pytest

from tokenmill.engine.stops import StopMatcher
from tokenmill.http.openai.chat import (
    ChatError,
    parse_messages,
    parse_tools,
    render_prompt,
    template_kwargs,
    tool_call_schema,
    tool_grammar,
    tools_to_offer,
)
from tokenmill.http.openai.reading import OutputFormat, OutputReader, read_output
from tokenmill.http.openai.schemas import ChatRequest, NamedToolChoice
from tokenmill.http.openai.schemas import Tool as ToolSpec
from tokenmill.http.openai.shapes import StopHoldback
from tokenmill.http.schemas import ValidationError, check_body
from tokenmill.model.chat_template import read_chat_template, use_chat_template
from tokenmill.model.loading import ModelLoadError
from tokenmill.plugin_manager import build_plugin_manager, choose
from tokenmill.sampling.grammar import GrammarCompiler

TGI_OUTPUT = OutputFormat((), choose(build_plugin_manager(autoload=False), "tool_parser", "tgi"))


def chat_messages(messages: list[dict]) -> list[dict]:
    """``messages`` as a chat request's model reads them, then as the chat template gets them."""
    return parse_messages(check_body(ChatRequest, {"messages": messages}).messages)


def named_choice(name: str) -> NamedToolChoice:
    return NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})


TOOLS = parse_tools([ToolSpec.model_validate(tool) for tool in [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}},
]])


class NoTemplate:
    chat_template = None


def test_a_tokenizer_without_a_chat_template_is_refused_with_the_way_out():
    with pytest.raises(ChatError, match="no chat template.*/v1/completions"):
        render_prompt(NoTemplate(), chat_messages([{"role": "user", "content": "hi"}]), [], True)


def test_messages_accept_text_parts_and_map_developer_to_system():
    messages = chat_messages([{"role": "developer", "content": "Be brief."},
                               {"role": "user",
                                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "ab"}]
    with pytest.raises(ValidationError, match=r"messages\[0\].role"):
        chat_messages([{"role": "wizard", "content": "x"}])
    with pytest.raises(ChatError, match="takes no images"):
        chat_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_tool_choice_decides_what_the_output_may_be():
    assert tools_to_offer(TOOLS, None) == (TOOLS, True)
    assert tools_to_offer(TOOLS, "none") == ([], True)
    assert tools_to_offer(TOOLS, "required") == (TOOLS, False)
    assert tools_to_offer(TOOLS, named_choice("get_time")) == ([TOOLS[1]], False)
    with pytest.raises(ChatError, match="get_weather, get_time"):
        tools_to_offer(TOOLS, named_choice("launch_rocket"))
    with pytest.raises(ChatError, match="needs `tools`"):
        tools_to_offer([], "required")


def test_the_call_schema_accepts_exactly_the_valid_calls_of_the_offered_tools():
    schema = tool_call_schema(TOOLS)
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Paris"}}, schema)
    jsonschema.validate({"name": "get_time", "arguments": {}}, schema)
    for wrong in ({"name": "get_weather", "arguments": {}}, {"name": "other", "arguments": {}},
                  {"name": "get_time", "arguments": {}, "extra": 1}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)


def tgi_calls(text: str, final: bool = True) -> list[tuple[str, str]]:
    """The calls the ``tgi`` parser reads in a grammar-held output."""
    return [(call.name, call.arguments) for call in read_output(TGI_OUTPUT, text, final).calls]


def test_an_output_is_a_call_once_the_call_has_named_its_tool():
    ((name, arguments),) = tgi_calls('{"name": "get_weather", "arguments": {"city": "Paris"}}')
    assert name == "get_weather" and json.loads(arguments) == {"city": "Paris"}
    assert tgi_calls("It is sunny.") == []
    assert tgi_calls('{"name": "get_wea') == []  # cut short by max_tokens before the name is whole
    assert tgi_calls('{"name": "get_weather", "argu') == [("get_weather", "")]
    assert tgi_calls('{"name": "get_weather", "arguments": {"ci') == [("get_weather", '{"ci')]  # as far as it got


PARALLEL = ('{"name": "get_weather", "arguments": {"city": "Pa\\"ris}{", "n": [1, {"a": null}]}}\n'
            '{"name": "get_time", "arguments": {}}\n{"name": "ping", "arguments": 42}\n'
            '{"name": "echo", "arguments": "a \\"}\\" b"}')


def test_parallel_calls_stream_with_the_arguments_as_written_whatever_the_pieces():
    expected = [("get_weather", '{"city": "Pa\\"ris}{", "n": [1, {"a": null}]}'), ("get_time", "{}"),
                ("ping", "42"), ("echo", '"a \\"}\\" b"')]
    assert tgi_calls(PARALLEL) == expected
    rng = random.Random(0)
    for _ in range(50):
        reader, names, arguments = OutputReader(TGI_OUTPUT), {}, {}
        cuts = sorted(rng.sample(range(1, len(PARALLEL)), 12))
        pieces = [PARALLEL[start:end] for start, end in zip([0, *cuts], [*cuts, len(PARALLEL)])]
        for number, piece in enumerate(pieces):
            for delta in reader.push(piece, final=number == len(pieces) - 1):
                for call in delta["tool_calls"]:
                    if "id" in call:
                        assert call["index"] == len(names) and call["function"]["arguments"] == ""  # opens once
                        names[call["index"]] = call["function"]["name"]
                    else:
                        arguments[call["index"]] = arguments.get(call["index"], "") + call["function"]["arguments"]
        assert [(names[i], arguments.get(i, "")) for i in sorted(names)] == expected
        assert reader.sent.finished_calls and len(set(reader.ids)) == 4


def test_the_calls_say_when_they_are_not_whole():
    cut = read_output(TGI_OUTPUT, '{"name": "get_time", "arguments": {}}\n{"name": "get_time", "arguments": '
                                  '{"zone": "UTC"}', final=True)
    assert len(cut.calls) == 2 and not cut.calls[1].complete and not cut.finished_calls
    assert read_output(TGI_OUTPUT, '{"name": "get_time", "arguments": {"zone": "UTC"}}', final=True).finished_calls


def test_parallel_tool_calls_decide_whether_the_grammar_allows_more_than_one(tiny_model):
    _, tokenizer = tiny_model
    compiler = GrammarCompiler(tokenizer, len(tokenizer))
    compiler.ll_tokenizer()  # built once first, outside the tools' compile-time limit (a busy machine is slow)
    one = '{"name": "get_time", "arguments": {}}'

    def accepts(grammar, text):
        matcher = grammar.new_matcher().matcher
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return all(matcher.consume_token(i) for i in ids) and matcher.is_accepting()

    for text_allowed in (False, True):
        parallel, single = (tool_grammar(compiler, TOOLS, text_allowed, parallel) for parallel in (True, False))
        assert accepts(parallel, one) and accepts(parallel, one + "\n" + one) and accepts(single, one)
        assert not accepts(single, one + "\n" + one)
        assert accepts(parallel, "It is sunny.") == text_allowed == accepts(single, "It is sunny.")


def test_chat_template_kwargs_are_template_variables_that_cannot_replace_the_calls_own(tiny_model):
    _, tokenizer = tiny_model
    assert template_kwargs(tokenizer, {"enable_thinking": False}) == {"enable_thinking": False}
    assert template_kwargs(tokenizer, None) == {}
    for key in ("messages", "tools", "add_generation_prompt", "tokenize", "chat_template", "return_dict"):
        with pytest.raises(ChatError, match=f"may not set {key}"):
            template_kwargs(tokenizer, {key: True})
    with pytest.raises(ValidationError, match="`chat_template_kwargs` must be an object"):
        check_body(ChatRequest, {"messages": [{"role": "user", "content": "hi"}],
                                 "chat_template_kwargs": ["enable_thinking"]})
    messages = chat_messages([{"role": "user", "content": "hi"}])
    templated = copy.deepcopy(tokenizer)
    templated.chat_template = "{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}"
    assert render_prompt(templated, messages, [], True, template_kwargs={"greeting": "Hello "}) == "Hello hi"


def test_past_tool_calls_are_shown_as_the_json_the_model_writes_when_the_template_has_no_tool_support(tiny_model):
    _, tokenizer = tiny_model
    messages = chat_messages([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ])
    prompt = render_prompt(tokenizer, messages, TOOLS, True)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "You can call these functions" in prompt and prompt.endswith("<|im_start|>assistant\n")


def streamed(stops: tuple[str, ...], pieces: list[str]) -> tuple[list[str], StopHoldback]:
    """What a stream sends of each piece, given the engine's count of held-back characters."""
    matcher, holdback = StopMatcher(stops), StopHoldback(stops)
    sent = []
    for piece in pieces:
        matcher.feed(piece)
        sent.append(holdback.push(piece, matcher.held))
    return sent, holdback


def test_streamed_text_holds_back_what_may_begin_a_stop_sequence():
    pieces, holdback = streamed(("\n\nEND",), ["Hello", "\n", "\nE", "ND", " more"])
    assert pieces == ["Hello", "", "", "", ""] and holdback.finish() == ""
    pieces, holdback = streamed(("\n\nEND",), ["Hi", "\n", "x"])
    pieces.append(holdback.finish())
    assert "".join(pieces) == "Hi\nx" and pieces[1] == ""


def test_stop_sequences_are_found_one_character_at_a_time_in_linear_time():
    matcher = StopMatcher(("abab", "x" * 512))
    assert not matcher.feed("aba") and matcher.held == 3
    assert not matcher.feed("c") and matcher.held == 0
    assert matcher.feed("ababab")
    long = StopMatcher(("a" * 511 + "b",))
    assert not long.feed("a" * 100_000) and long.held == 511  # never searched again: one pass over the text
    assert long.feed("b")


def test_the_operators_chat_template_is_read_from_text_a_file_or_a_tokenizer_config(tmp_path, tiny_model):
    template = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "default", "template": template}, {"name": "tool_use", "template": "{{ tools }}"}]}))
    assert read_chat_template(SimpleNamespace(chat_template=template)) == template
    assert read_chat_template(SimpleNamespace(chat_template=str(tmp_path / "t.jinja"))) == template
    named = read_chat_template(SimpleNamespace(tokenizer_config_path=str(tmp_path / "tokenizer_config.json")))
    assert named == {"default": template, "tool_use": "{{ tools }}"}
    assert read_chat_template(SimpleNamespace()) is None  # the model's own stays
    tokenizer = copy.deepcopy(tiny_model[1])
    use_chat_template(tokenizer, named)
    assert render_prompt(tokenizer, chat_messages([{"role": "user", "content": "hi"}]), [], True) == "[hi]"


@pytest.mark.parametrize("settings, line", [
    ({"chat_template": "/no/such/template.jinja"}, "--chat-template: no such file '/no/such/template.jinja'"),
    ({"chat_template": "{{ unclosed"}, "--chat-template: the Jinja template does not compile"),
    ({"tokenizer_config_path": "/no/such/tokenizer_config.json"}, "no such file"),
    ({"tokenizer_config_path": "HERE/t.jinja"}, "not a readable JSON file"),
    ({"tokenizer_config_path": "HERE/empty.json"}, "it has no `chat_template`"),
    ({"chat_template": "{{ x }}", "tokenizer_config_path": "HERE/empty.json"}, "both set the chat template"),
])
def test_a_chat_template_that_cannot_be_used_is_one_line_that_says_why(tmp_path, settings, line):
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    (tmp_path / "empty.json").write_text("{}")
    settings = {key: value.replace("HERE", str(tmp_path)) for key, value in settings.items()}
    with pytest.raises(ModelLoadError, match=re.escape(line)) as failure:
        read_chat_template(SimpleNamespace(**settings))
    assert "\n" not in str(failure.value)
