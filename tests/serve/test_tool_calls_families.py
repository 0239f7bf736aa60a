"""Tool calls of the DeepSeek-V3, GLM-4.5, Llama-4 and GPT-OSS (harmony) families through the official openai
client against the app in process around a tiny random checkpoint of each (tool_chats.py): a call forced by
tool_choice (required, or a named function) comes back parsed, whole and streamed, with arguments that validate
against the function's schema; a call and its result fed back render through the template."""

import json

import jsonschema
import openai
import pytest
import torch
from fastapi.testclient import TestClient

import moeserve
from moeserve.engine.batching import ContinuousBatch
from moeserve.serve.app import ServerState, build_app
from moeserve.serve.batcher import Engine
from moeserve.serve.chat_template import ChatTemplate
from moeserve.serve.metrics import Metrics
from moeserve.serve.protocol import Message
from moeserve.serve.tool_formats import detect
from moeserve.tokenizer import load_tokenizer
from qwen_chat import SEARCH, WEATHER
from single_thread import one_thread  # noqa: F401 - autouse fixture
from tool_chats import save_family_chat_model

pytest.importorskip("xgrammar")
CONTEXT = 2048
USER = [{"role": "user", "content": "what is the weather in paris"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, SEARCH)}
FED_BACK = {  # family -> how the call of test_call_and_result_are_fed_back renders
    "deepseek_v3": '<｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n{"query": "rain", "top": true}\n```'
                   '<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜><｜tool▁outputs▁begin｜>'
                   '<｜tool▁output▁begin｜>it rains<｜tool▁output▁end｜><｜tool▁outputs▁end｜>',
    "glm4_moe": "<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>rain</arg_value>\n<arg_key>top</arg_key>\n"
                "<arg_value>true</arg_value>\n</tool_call><|observation|>\n<tool_response>\nit rains\n</tool_response>",
    "llama4": '{"name": "search", "parameters": {"query": "rain", "top": true}}<|eot|><|header_start|>ipython'
              '<|header_end|>\n\nit rains<|eot|>',
    "gpt_oss": '<|start|>assistant to=functions.search<|channel|>commentary json<|message|>{"query": "rain", "top": '
               'true}<|call|><|start|>functions.search to=assistant<|channel|>commentary<|message|>it rains<|end|>',
}
FORMATS = {"deepseek_v3": "DeepSeek-V3", "glm4_moe": "GLM-4.5", "llama4": "Llama-3.1/4 JSON",
           "gpt_oss": "harmony (GPT-OSS)"}


@pytest.fixture(scope="module", params=list(FED_BACK))
def served(request, tmp_path_factory):
    """(family, checkpoint path, openai client) of a server as `moeserve serve` sets it up."""
    family = request.param
    path = save_family_chat_model(family, tmp_path_factory.mktemp(family))
    model, tok = moeserve.load_model(path, dtype=torch.float32), load_tokenizer(path)
    template = ChatTemplate.from_dir(path)
    fmt = detect(template.source)
    assert fmt is not None and fmt.name == FORMATS[family]
    tok.show(fmt.markers)  # as serve/server.py does: the markers are text, in answers and for grammars
    for marker in fmt.markers:
        (token,) = tok.encode(marker, add_special_tokens=False)
        assert tok.decode([5, token]) == tok.decode([5]) + marker and tok.vocab_bytes()[token] == marker.encode()
    engine = Engine(ContinuousBatch(model, tok, slots=2, context=CONTEXT), Metrics(family, 2), max_queue=8,
                    threads=1)
    engine.start()
    state = ServerState(tok, template, family, CONTEXT, model.spec.vocab_size, Metrics(family, 2), engine=engine)
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=TestClient(build_app(state)),
                           max_retries=0)
    yield family, path, client
    engine.stop()


def check_call(call, allowed=SCHEMAS):
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in allowed
    jsonschema.validate(json.loads(call.function.arguments), allowed[call.function.name])


def test_required_tool_call_is_forced_and_parsed(served):
    family, _, client = served
    r = client.chat.completions.create(model=family, messages=USER, tools=[WEATHER, SEARCH], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=300, temperature=1.0, seed=1)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content, choice.message
    assert len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0])


def test_named_tool_call_streams_whole_calls(served):
    family, _, client = served
    kw = dict(model=family, messages=USER, tools=[WEATHER, SEARCH], max_tokens=300, temperature=1.0, seed=5,
              parallel_tool_calls=False, tool_choice={"type": "function", "function": {"name": "search"}})
    chunks = list(client.chat.completions.create(stream=True, **kw))
    calls = [c for ch in chunks for c in (ch.choices[0].delta.tool_calls or [])]
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks)
    check_call(calls[0], {"search": SCHEMAS["search"]})
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in whole] == [(calls[0].function.name,
                                                                          calls[0].function.arguments)]


def test_call_and_result_are_fed_back(served):
    family, path, client = served
    call = {"id": "call_9", "type": "function", "function": {"name": "search",
                                                           "arguments": '{"query": "rain", "top": true}'}}
    messages = [{"role": "system", "content": "be brief"}, *USER,
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_9", "content": "it rains"}]
    prompt = ChatTemplate.from_dir(path).render([Message.model_validate(m).as_dict() for m in messages], True,
                                               [WEATHER, SEARCH])
    assert FED_BACK[family] in prompt and "get_weather" in prompt and "be brief" in prompt
    r = client.chat.completions.create(model=family, messages=messages, tools=[SEARCH], max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_responses_api_forced_call(served):
    """client.responses.create with tool_choice required: one function_call item whose arguments validate."""
    family, _, client = served
    tools = [{"type": "function", **t["function"]} for t in (WEATHER, SEARCH)]
    r = client.responses.create(model=family, input="weather?", tools=tools, tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=300, temperature=1.0)
    calls = [i for i in r.output if i.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])
