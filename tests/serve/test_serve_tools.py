"""What applications send a chat server, through the official openai client against the app in process around a
tiny random Qwen3-MoE that chats as Qwen3 does (qwen_chat.py): structured output held by a grammar, tool calls
(rendered by the template, forced by a grammar, parsed whole and streamed, fed back), reasoning content and
chat_template_kwargs. The template opens a thinking section, after which a grammar starts: the tests of the
grammar alone turn thinking off (enable_thinking false; the Responses API's reasoning effort "none")."""

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
from moeserve.tokenizer import load_tokenizer
from json_schemas import random_schema
from qwen_chat import SEARCH, WEATHER, save_qwen_chat_model
from single_thread import one_thread  # noqa: F401 - autouse fixture

pytest.importorskip("xgrammar")
CONTEXT = 2048
USER = [{"role": "user", "content": "what is the weather in paris"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, SEARCH)}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = save_qwen_chat_model(tmp_path_factory.mktemp("qwen-chat"))
    model, tok = moeserve.load_model(path, dtype=torch.float32), load_tokenizer(path)
    engine = Engine(ContinuousBatch(model, tok, slots=4, context=CONTEXT), Metrics("qwen", 4), max_queue=8, threads=1)
    engine.start()
    state = ServerState(tok, ChatTemplate.from_dir(path), "qwen", CONTEXT, model.spec.vocab_size, Metrics("qwen", 4),
                        engine=engine)
    yield path, TestClient(build_app(state))
    engine.stop()


@pytest.fixture(scope="module")
def client(qwen):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=qwen[1], max_retries=0)


def test_template_renders_tools_and_calls_as_transformers_does(qwen):
    from transformers import AutoTokenizer

    path, _ = qwen
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": '{"city": "Paris", "days": 2, "unit": "c"}'}}
    messages = [{"role": "system", "content": "be brief"}, *USER,
                {"role": "assistant", "content": "", "tool_calls": [call], "reasoning_content": "need weather"},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    ours = [Message.model_validate(m).as_dict() for m in messages]
    assert ours[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 2, "unit": "c"}
    hf = AutoTokenizer.from_pretrained(path)
    for thinking in (True, False):
        want = hf.apply_chat_template(ours, tools=[WEATHER, SEARCH], tokenize=False, add_generation_prompt=True,
                                      enable_thinking=thinking)
        got = ChatTemplate.from_dir(path).render(ours, True, [WEATHER, SEARCH], enable_thinking=thinking)
        assert got == want and '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in got
        assert got.endswith("<|im_start|>assistant\n<think>\n" if thinking else "<think>\n\n</think>\n\n")


def check_call(call, allowed=SCHEMAS):
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in allowed
    jsonschema.validate(json.loads(call.function.arguments), allowed[call.function.name])


def test_required_tool_call_is_forced_and_parsed(client):
    r = client.chat.completions.create(model="qwen", messages=USER, tools=[WEATHER, SEARCH], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=300, temperature=1.0, seed=1)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0])


def test_named_tool_call_streams_whole_calls(client):
    kw = dict(model="qwen", messages=USER, tools=[WEATHER, SEARCH], max_tokens=600, temperature=1.0, seed=5,
              tool_choice={"type": "function", "function": {"name": "search"}}, extra_body=NO_THINKING)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    calls = [c for ch in chunks for c in (ch.choices[0].delta.tool_calls or [])]
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and calls
    assert [c.index for c in calls] == list(range(len(calls)))
    for c in calls:
        check_call(c, {"search": SCHEMAS["search"]})
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in whole] == [
        (c.function.name, c.function.arguments) for c in calls]


def test_tool_results_are_fed_back(client):
    call = {"id": "call_9", "type": "function", "function": {"name": "search",
                                                           "arguments": '{"query": "rain", "top": true}'}}
    r = client.chat.completions.create(model="qwen", messages=[
        *USER, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_9", "content": "it rains"}], tools=[SEARCH], max_tokens=5,
        temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_reasoning_content_is_split_off(qwen, client):
    """The template opens a thinking section: the answer up to </think> is reasoning_content, whole and streamed;
    with enable_thinking false (chat_template_kwargs) it is all content."""
    _, http = qwen
    kw = dict(model="qwen", messages=USER, max_tokens=24, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0].message
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ids = http.post("/tokenize", json={"messages": USER}).json()["tokens"]
    raw = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 24, "temperature": 0}).json()
    raw = raw["choices"][0]["text"]
    thought, _, after = raw.partition("</think>")
    assert whole.reasoning_content == (thought or None) and streamed == thought
    assert whole.content == after.lstrip("\n") == content
    off = client.chat.completions.create(extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **kw)
    assert off.choices[0].message.reasoning_content is None


def test_structured_output_holds_for_20_random_schemas(client):
    """Every answer parses and validates against its schema, and ends because the grammar ended (finish stop)."""
    import random

    rng = random.Random(11)
    for n in range(20):
        schema = random_schema(rng)
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{n}", "schema": schema, "strict": True}}
        if n % 2:
            r = client.completions.create(model="qwen", prompt="data:", max_tokens=800, temperature=1.0, seed=n,
                                          extra_body={"response_format": fmt})
            text = r.choices[0].text
        else:
            r = client.chat.completions.create(model="qwen", messages=USER, max_tokens=800, temperature=1.0, seed=n,
                                               response_format=fmt, extra_body=NO_THINKING)
            text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", (n, text)
        jsonschema.validate(json.loads(text), schema)
    r = client.chat.completions.create(model="qwen", messages=USER, max_tokens=800, temperature=1.0, seed=3,
                                       response_format={"type": "json_object"}, extra_body=NO_THINKING)
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)


def test_a_grammar_starts_after_the_thinking_section(qwen, client):
    """The template opens a thinking section: each choice thinks in free text (no stop token until </think>), then
    its content is held to the grammar (a JSON schema; a forced tool call), or it runs out of tokens first."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    for extra in ({"response_format": fmt}, {"tools": [WEATHER], "tool_choice": "required"}):
        r = client.chat.completions.create(model="qwen", messages=USER, max_tokens=200, temperature=1.0, seed=1, n=8,
                                           **extra)
        closed = [c for c in r.choices if c.finish_reason != "length"]
        assert closed and all(c.message.reasoning_content for c in r.choices)
        for c in closed:
            if "tools" in extra:
                assert c.finish_reason == "tool_calls" and c.message.content is None
                check_call(c.message.tool_calls[0], {"get_weather": SCHEMAS["get_weather"]})
            else:
                assert c.finish_reason == "stop" and json.loads(c.message.content) in ({"ok": True}, {"ok": False})
            with pytest.raises(json.JSONDecodeError):  # free text, not the grammar's JSON
                json.loads(c.message.reasoning_content)
    _, http = qwen
    r = http.post("/v1/responses", json={"input": "x", "reasoning": {"effort": "high"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning"


def test_responses_api_whole_and_streamed(qwen, client):
    """client.responses.create: instructions and input become the chat the template renders; the answer's thinking
    is a reasoning item and its text a message item, whole and as typed events that add up to it."""
    _, http = qwen
    kw = dict(model="qwen", input="what is the weather", instructions="be brief", max_output_tokens=16, temperature=0)
    r = client.responses.create(**kw)
    chat = client.chat.completions.create(model="qwen", messages=[{"role": "system", "content": "be brief"},
                                                                  {"role": "user", "content": "what is the weather"}],
                                          max_tokens=16, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 16 and r.usage.input_tokens == chat.usage.prompt_tokens
    reasoning = [i for i in r.output if i.type == "reasoning"]
    assert reasoning[0].content[0].text == chat.choices[0].message.reasoning_content
    assert r.output_text == (chat.choices[0].message.content or "")
    events = list(client.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning[0].content[0].text
    assert events[-1].response.output[0].content[0].text == reasoning[0].content[0].text
    r = http.post("/v1/responses", json={**kw, "previous_response_id": "resp_1"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"


def test_responses_api_tools_and_structured_output(client):
    call = {"type": "function_call", "call_id": "call_3", "name": "search", "arguments": '{"query": "sun", "top": true}'}
    tools = [{"type": "function", **t["function"]} for t in (WEATHER, SEARCH)]
    kw = dict(model="qwen", input=[{"role": "user", "content": "weather?"}, call,
                                   {"type": "function_call_output", "call_id": "call_3", "output": "sunny"}],
              tools=tools, tool_choice="required", parallel_tool_calls=False, max_output_tokens=300, temperature=1.0,
              reasoning={"effort": "none"})
    r = client.responses.create(**kw)
    calls = [i for i in r.output if i.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])
    events = list(client.responses.create(stream=True, **kw))
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert len(done) == 1 and events[-1].type == "response.completed"
    jsonschema.validate(json.loads(done[0].arguments), SCHEMAS[done[0].name])
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 99}},
              "required": ["ok", "n"], "additionalProperties": False}
    r = client.responses.create(model="qwen", input="json please", max_output_tokens=300, temperature=1.0,
                                text={"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}},
                                reasoning={"effort": "none"})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
