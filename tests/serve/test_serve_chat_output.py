"""Splitting answers into reasoning, content and tool calls: streamed in random pieces it gives what it gives whole."""

import json
import random

import pytest

from moeserve.serve.chat_output import ChatOutput
from moeserve.serve.reasoning import ThinkSplitter, opens_thinking
from moeserve.serve.tool_formats import detect
from moeserve.serve.tool_formats.hermes import Hermes

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
CASES = [  # (answer, starts in thinking, reasoning, content, calls)
    ("<think>\nplan it\n</think>\n\nIt is sunny.", False, "\nplan it\n", "It is sunny.", []),
    ("plan it</think>\n\nSunny.", True, "plan it", "Sunny.", []),
    ("No thinking <think> here", False, "", "No thinking <think> here", []),
    ("still thinking <", True, "still thinking <", "", []),
    (f"<think>x</think>\n\nLet me check.\n{CALL}\n{CALL.replace('Paris', 'Rome')}", False, "x", "Let me check.\n",
     ["Paris", "Rome"]),
    ("<tool_call>\nnot json\n</tool_call> and <tool_c", False, "", "<tool_call>\nnot json\n</tool_call> and <tool_c",
     []),
    (f"{CALL}\n<tool_call>\n{{\"name\": \"f\"", False, "", '<tool_call>\n{"name": "f"', ["Paris"]),
]


def split(pieces, in_thinking):
    out = ChatOutput(ThinkSplitter(in_thinking), Hermes().parser([]))
    reasoning, content, calls = "", "", []
    for n, p in enumerate(pieces):
        got = out.feed(p, final=n == len(pieces) - 1)
        reasoning, content, calls = reasoning + got.reasoning, content + got.content, calls + got.calls
    return reasoning, content, calls


@pytest.mark.parametrize("answer,in_thinking,reasoning,content,cities", CASES)
def test_pieces_add_up_to_the_whole(answer, in_thinking, reasoning, content, cities):
    whole = split([answer], in_thinking)
    assert whole[:2] == (reasoning, content)
    assert [json.loads(c.arguments)["city"] for c in whole[2]] == cities
    assert all(c.name == "get_weather" for c in whole[2])
    rng = random.Random(0)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(answer)), min(6, len(answer) - 1)))
        pieces = [answer[a:b] for a, b in zip([0, *cuts], [*cuts, len(answer)])]
        got = split(pieces, in_thinking)
        assert got[:2] == whole[:2] and [c.arguments for c in got[2]] == [c.arguments for c in whole[2]]


def test_prompt_that_opens_thinking():
    assert opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n") and not opens_thinking("hi")


def test_only_templates_that_teach_the_json_shape_are_hermes():
    hermes = 'calls within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": {}}'
    glm = "<tool_call>{{ tc.name }}<arg_key>{{ k }}</arg_key><arg_value>{{ v }}</arg_value></tool_call>"
    assert detect(hermes).name == "Hermes/Qwen" and detect(glm).name == "GLM-4.5" and detect("{{ messages }}") is None
