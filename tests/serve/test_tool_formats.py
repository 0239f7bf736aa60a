"""The tool-call formats on hand-written answers: each format is found from its template's markers, parses one
call, two calls and text around them, leaves a malformed call as text, gives the same streamed in random pieces
as whole, and its forcing grammar accepts the calls it writes."""

import json
import random

import pytest

from moeserve.serve.chat_template import ChatTemplate
from moeserve.serve.reasoning import ThinkSplitter
from moeserve.serve.tool_formats import FORMATS, detect

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1}},
           "required": ["city", "days"], "additionalProperties": False}
FUNCTIONS = [("get_weather", WEATHER), ("search", {"type": "object", "properties": {"q": {"type": "string"}}})]
DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"


def hermes(city):
    return f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}", "days": 2}}}}\n</tool_call>'


def deepseek_v3(city):
    return (f'<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{{"city": "{city}", "days": 2}}\n```'
            f'<｜tool▁call▁end｜>')


def deepseek_v31(city):
    return f'<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{{"city": "{city}", "days": 2}}<｜tool▁call▁end｜>'


def glm(city):
    return (f"<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>{city}</arg_value>\n"
            f"<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>")


def llama(city):
    return f'{{"name": "get_weather", "parameters": {{"city": "{city}", "days": 2}}}}'


def harmony(city):
    return f'<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{{"city": "{city}", "days": 2}}'


# format name -> (template text that teaches it, [(answer, content, cities)])
CASES = {
    "Hermes/Qwen": ('<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>', [
        (hermes("Paris"), "", ["Paris"]),
        (f"Let me check.\n{hermes('Paris')}\n{hermes('Rome')}", "Let me check.\n", ["Paris", "Rome"]),
        ("<tool_call>\nnot json\n</tool_call> and <tool_c", "<tool_call>\nnot json\n</tool_call> and <tool_c", []),
    ]),
    "DeepSeek-V3": ("{{'<｜tool▁calls▁begin｜>' + name + '\\n```json\\n' + args}}", [
        (DS_BEGIN + deepseek_v3("Paris") + DS_END, "", ["Paris"]),
        ("Sure." + DS_BEGIN + deepseek_v3("Paris") + "\n" + deepseek_v3("Rome") + DS_END, "Sure.", ["Paris", "Rome"]),
        (DS_BEGIN + deepseek_v3("Paris").replace('"days": 2}', '"days": ') + DS_END,
         DS_BEGIN + deepseek_v3("Paris").replace('"days": 2}', '"days": ') + DS_END, []),
    ]),
    "DeepSeek-V3.1": ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + name + '<｜tool▁sep｜>' + args}}", [
        (DS_BEGIN + deepseek_v31("Paris") + DS_END, "", ["Paris"]),
        (DS_BEGIN + deepseek_v31("Paris") + deepseek_v31("Rome") + DS_END, "", ["Paris", "Rome"]),
        (DS_BEGIN + "get_weather{}" + DS_END, DS_BEGIN + "get_weather{}" + DS_END, []),
    ]),
    "GLM-4.5": ("<tool_call>{{ name }}\n<arg_key>{{ k }}</arg_key>\n<arg_value>{{ v }}</arg_value>", [
        (glm("Paris"), "", ["Paris"]),
        (f"Checking.\n{glm('Paris')}\n{glm('Rome')}", "Checking.\n", ["Paris", "Rome"]),
        ("<tool_call>get weather\n<arg_key>city</arg_key></tool_call>",
         "<tool_call>get weather\n<arg_key>city</arg_key></tool_call>", []),
    ]),
    "Llama-3.1/4 JSON": ('Respond in the format {"name": function name, "parameters": dictionary of argument name', [
        (llama("Paris"), "", ["Paris"]),
        ("<|python_start|>" + llama("Paris") + llama("Rome") + "<|python_end|>", "", ["Paris", "Rome"]),
        ('{"name": "get_weather", "parameters": {"city": ', '{"name": "get_weather", "parameters": {"city": ', []),
        ("It is {sunny}.", "It is {sunny}.", []),
    ]),
    "harmony (GPT-OSS)": ("{{ '<|start|>assistant<|channel|>final<|message|>' + content }}", [
        ("<|channel|>analysis<|message|>need weather<|end|><|start|>assistant" + harmony("Paris"), "", ["Paris"]),
        (harmony("Paris") + "<|call|><|start|>assistant" + harmony("Rome"), "", ["Paris", "Rome"]),
        (harmony("Paris")[:-12], '{"city": "Paris"', []),
        ("<|channel|>final<|message|>It is sunny.<|return|>", "It is sunny.", []),
    ]),
}
BY_NAME = {f.name: f for f in FORMATS}


def split(fmt, pieces):
    out = fmt.output(None, FUNCTIONS)
    content, calls = "", []
    for n, p in enumerate(pieces):
        got = out.feed(p, final=n == len(pieces) - 1)
        content, calls = content + got.content, calls + got.calls
    return content, calls


@pytest.mark.parametrize("name", CASES)
def test_format_is_found_from_its_template(name):
    assert detect(CASES[name][0]) is BY_NAME[name]
    assert detect("{{ messages }}") is None


@pytest.mark.parametrize("name,case", [(n, c) for n in CASES for c in CASES[n][1]])
def test_answers_parse_whole_and_streamed(name, case):
    answer, content, cities = case
    fmt = BY_NAME[name]
    whole = split(fmt, [answer])
    assert whole[0] == content and [json.loads(c.arguments) for c in whole[1]] == [
        {"city": c, "days": 2} for c in cities]
    assert all(c.name == "get_weather" for c in whole[1])
    rng = random.Random(0)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(answer)), min(6, len(answer) - 1)))
        got = split(fmt, [answer[a:b] for a, b in zip([0, *cuts], [*cuts, len(answer)])])
        assert got[0] == whole[0] and [c.arguments for c in got[1]] == [c.arguments for c in whole[1]]


def test_harmony_splits_channels_without_tools():
    """A GPT-OSS answer without tools: analysis is reasoning, final is content, a stray call's body is content."""
    out = BY_NAME["harmony (GPT-OSS)"].output(ThinkSplitter(False), None)
    got = out.feed("<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>Hi", True)
    assert (got.reasoning, got.content, got.calls) == ("think", "Hi", []) and out.thinks


@pytest.mark.parametrize("name", CASES)
def test_forcing_grammar_accepts_the_calls_it_parses(name):
    """Each format's grammar (one call and two) accepts the format's calls, and what it accepts parses back."""
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    fmt = BY_NAME[name]
    one, two = [a for a, _, cities in CASES[name][1] if cities][:2]
    one = one.split("<|start|>assistant")[-1]  # harmony: the grammar holds the call message alone
    if name == "DeepSeek-V3" or name == "DeepSeek-V3.1" or name == "Llama-3.1/4 JSON":
        two = two.removeprefix("Sure.").removeprefix("<|python_start|>").removesuffix("<|python_end|>")
    if name in ("Hermes/Qwen", "GLM-4.5"):
        two = two.split("\n", 1)[1]  # the text before the calls
    compile_ = lambda parallel: xgr.Grammar.from_structural_tag(  # noqa: E731
        {"type": "structural_tag", "format": fmt.grammar(FUNCTIONS, parallel)})
    assert _is_grammar_accept_string(compile_(False), one)
    if name != "harmony (GPT-OSS)":  # a harmony call ends the turn: one a turn
        assert _is_grammar_accept_string(compile_(True), two) and not _is_grammar_accept_string(compile_(False), two)
    assert not _is_grammar_accept_string(compile_(True), "It is sunny.")
    assert [c.name for c in split(fmt, [one])[1]] == ["get_weather"]


def test_tool_call_arguments_render_as_object_and_as_text():
    """A call fed back renders in every template style: joined to a string (DeepSeek), tojson (Qwen, Llama),
    items() (GLM)."""
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1, "b": "x"}}}]}
    source = ("{% for m in messages %}{% for c in m.tool_calls or [] %}"
              "{{ '[' + c.function.arguments + ']' }}|{{ c.function.arguments | tojson }}|{{ c.function.arguments }}|"
              "{% for k, v in c.function.arguments.items() %}{{ k }}={{ v }};{% endfor %}"
              "{% endfor %}{% endfor %}")
    assert ChatTemplate(source).render([call]) == '[{"a": 1, "b": "x"}]|{"a": 1, "b": "x"}|{"a": 1, "b": "x"}|a=1;b=x;'


def test_a_turn_of_calls_has_no_content_where_the_template_asks_for_none():
    """DeepSeek's templates render an assistant turn's calls only when its content is none: a turn of calls alone
    gets None there (sent as "" or null); other templates get the text as sent."""
    turn = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}
    deepseek = ("{% for message in messages %}{% if message['content'] is none %}{{ 'calls ' + "
                "message['tool_calls'][0]['function']['arguments'] }}{% else %}text{% endif %}{% endfor %}")
    assert ChatTemplate(deepseek).render([turn]) == 'calls {"a": 1}'
    assert ChatTemplate(deepseek).render([{**turn, "content": "hm"}]) == "text"
    assert ChatTemplate("{% for m in messages %}[{{ m.content }}]{% endfor %}").render([turn]) == "[]"
