"""The app in process: before its engine exists (the model still loading) /health and requests answer 503, while bad
requests are still told what is wrong with them; then around the demo model's engine: null fields, refused fields,
the system fingerprint, metrics, methods, API keys and CORS."""

import json
import shutil

import pytest
import torch
from fastapi.testclient import TestClient

import moeserve
from moeserve.cli import build_parser
from moeserve.engine.batching import ContinuousBatch
from moeserve.serve.app import ServerState, build_app
from moeserve.serve.batcher import Engine
from moeserve.serve.chat_template import ChatTemplate
from moeserve.serve.metrics import Metrics
from moeserve.serve.protocol import ChatRequest, CompletionRequest
from moeserve.serve.server import system_fingerprint
from moeserve.tokenizer import load_tokenizer
from single_thread import one_thread  # noqa: F401 - autouse fixture


def test_loading_server_answers_503_but_checks_requests():
    state = ServerState(load_tokenizer(moeserve.DEMO_MODEL), ChatTemplate.from_dir(moeserve.DEMO_MODEL), "demo", 512,
                        258, Metrics("demo", 2), expose_metrics=True)
    client = TestClient(build_app(state))
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
    r = client.post("/v1/completions", json={"prompt": "KING.", "max_tokens": 4})
    assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": -2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert client.post("/tokenize", json={"prompt": "ab"}).json()["tokens"] == [256, 97, 98]  # needs no model
    assert client.get("/v1/models").json()["data"][0]["id"] == "demo"
    errors = client.get("/metrics").text  # the request refused while loading, the bad one (not /health)
    assert 'status="503"} 1.0' in errors and 'status="400"} 1.0' in errors


@pytest.fixture(scope="module")
def engine():
    """The demo model's engine thread (fp32, 4 slots), shared by the apps the tests build around it."""
    model, tok = moeserve.load_model(moeserve.DEMO_MODEL, dtype=torch.float32), load_tokenizer(moeserve.DEMO_MODEL)
    e = Engine(ContinuousBatch(model, tok, slots=4, context=512), Metrics("demo", 4), max_queue=8, threads=1)
    e.start()
    yield e
    e.stop()


def serving(engine, **state) -> TestClient:
    """The app in process, around the running engine; state: ServerState's options."""
    tok = engine.batch.tokenizer
    return TestClient(build_app(ServerState(tok, ChatTemplate.from_dir(moeserve.DEMO_MODEL), "demo", 512, 258,
                                            Metrics("demo", 4), engine=engine, **state)))


@pytest.fixture(scope="module")
def app(engine):
    return serving(engine, fingerprint=system_fingerprint(moeserve.DEMO_MODEL))


CHAT = {"messages": [{"role": "user", "content": "Who's there?"}]}
OPTIONAL_FIELDS = [("/v1/completions", {"prompt": "KING."}, name) for name, f in CompletionRequest.model_fields.items()
                   if not f.is_required()] + [
    ("/v1/chat/completions", CHAT, name) for name, f in ChatRequest.model_fields.items() if not f.is_required()]


@pytest.mark.parametrize("path,body,name", OPTIONAL_FIELDS, ids=[f"{p[4:]}-{n}" for p, _, n in OPTIONAL_FIELDS])
def test_null_is_the_fields_default(app, path, body, name):
    """The openai client sends null for an explicit None: every optional field takes it as its default."""
    limit = {"max_completion_tokens": 3} if name == "max_tokens" else {"max_tokens": 3}
    r = app.post(path, json={**body, "temperature": 0, **limit, name: None})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == (16 if (name, path) == ("max_tokens", "/v1/completions") else 3)


@pytest.mark.parametrize("path,field,value", [
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("/v1/chat/completions", "tools", [{"type": "retrieval"}]),
    ("/v1/chat/completions", "tool_choice", "any"),
    ("/v1/chat/completions", "functions", [{"name": "f", "parameters": {}}]),
    ("/v1/chat/completions", "function_call", "auto"),
    ("/v1/chat/completions", "response_format", {"type": "xml"}),
    ("/v1/chat/completions", "response_format", {"type": "json_schema"}),
    ("/v1/completions", "response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "no-such-type"}}}),
])
def test_fields_that_would_change_the_answer_are_refused(app, path, field, value):
    body = {**(CHAT if "chat" in path else {"prompt": "KING."}), "max_tokens": 2, field: value}
    r = app.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["message"].startswith(field)
    assert error["type"] == "invalid_request_error"


def test_neutral_tool_fields_are_accepted_and_no_tool_calls_are_shown(app):
    tools = [{"type": "function", "function": {"name": "f"}}]
    body = {**CHAT, "max_tokens": 2, "tool_choice": "none", "tools": tools, "response_format": {"type": "text"}}
    r = app.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert "tool_calls" not in r.json()["choices"][0]["message"]


def test_tool_choice_must_name_a_given_tool(app):
    for choice in ("required", {"type": "function", "function": {"name": "g"}}):
        body = {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": choice}
        r = app.post("/v1/chat/completions", json={**body, "tools": [] if choice == "required" else body["tools"]})
        assert r.status_code == 400 and "tool" in r.json()["error"]["message"], r.text


def test_answers_and_chunks_carry_the_system_fingerprint(app, tmp_path):
    fingerprint = system_fingerprint(moeserve.DEMO_MODEL)
    assert fingerprint.startswith(f"moeserve-{moeserve.__version__}-") and len(fingerprint.split("-")[-1]) == 12
    assert system_fingerprint(moeserve.DEMO_MODEL) == fingerprint  # stable
    other = tmp_path / "other"
    shutil.copytree(moeserve.DEMO_MODEL, other)
    (other / "config.json").write_text((other / "config.json").read_text().replace("}", ', "x": 1}', 1))
    assert system_fingerprint(other) != fingerprint
    whole = app.post("/v1/completions", json={"prompt": "KING.", "max_tokens": 2}).json()
    chat = app.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2}).json()
    with app.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 2, "stream": True,
                                                          "stream_options": {"include_usage": True}}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert len(chunks) >= 3
    assert {whole["system_fingerprint"], chat["system_fingerprint"]} | {c["system_fingerprint"] for c in chunks} == {
        fingerprint}


def test_metrics_are_served_unless_turned_off(engine):
    assert build_parser().parse_args(["serve"]).metrics is True
    assert build_parser().parse_args(["serve", "--metrics"]).metrics is True  # old command lines still work
    assert build_parser().parse_args(["serve", "--no-metrics"]).metrics is False
    assert "moeserve:kv_slots_total" in serving(engine).get("/metrics").text
    r = serving(engine, expose_metrics=False).get("/metrics")
    assert r.status_code == 404 and "--no-metrics" in r.json()["error"]["message"]


def test_a_wrong_method_is_a_client_error(app):
    r = app.get("/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_the_bearer_scheme_is_case_insensitive(engine):
    client = serving(engine, api_key="sesame")
    for header in ("Bearer sesame", "bearer sesame", "BEARER  sesame"):
        assert client.get("/v1/models", headers={"Authorization": header}).status_code == 200, header
    for header in ("Bearer sesam", "Basic sesame", "sesame", "bearersesame", "Bearer"):
        r = client.get("/v1/models", headers={"Authorization": header})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", header


def test_cors_with_allowed_origins(engine):
    assert build_parser().parse_args(["serve", "--allowed-origins", "https://a.example, http://b:3000"]
                                     ).allowed_origins == ("https://a.example", "http://b:3000")
    preflight = {"Origin": "https://a.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    off = serving(engine).options("/v1/completions", headers=preflight)
    assert off.status_code == 405 and "access-control-allow-origin" not in off.headers
    client = serving(engine, allowed_origins=("https://a.example",), api_key="sesame")
    r = client.options("/v1/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://a.example"
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = client.post("/v1/completions", json={"prompt": "KING.", "max_tokens": 2},
                    headers={"Origin": "https://a.example", "Authorization": "Bearer sesame"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://a.example"
    r = client.get("/health", headers={"Origin": "https://elsewhere.example"})
    assert "access-control-allow-origin" not in r.headers
    r = serving(engine, allowed_origins=("*",)).get("/health", headers={"Origin": "https://elsewhere.example"})
    assert r.headers["access-control-allow-origin"] == "*"


def test_ignore_eos_cannot_outrun_a_grammar(app):
    body = {**CHAT, "max_tokens": 2, "ignore_eos": True, "response_format": {"type": "json_object"}}
    r = app.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and "ignore_eos" in r.json()["error"]["message"]



def test_endpoints_answer_without_the_v1_prefix(app):
    """/chat/completions, /completions, /responses and /models are the /v1 endpoints (llama-server serves both)."""
    chat = {**CHAT, "max_tokens": 4, "temperature": 0}
    for path, body in (("/chat/completions", chat), ("/completions", {"prompt": "KING.", "max_tokens": 4,
                                                                       "temperature": 0})):
        short, full = app.post(path, json=body), app.post("/v1" + path, json=body)
        assert short.status_code == 200 and full.status_code == 200, short.text
        assert short.json()["choices"] == full.json()["choices"]
    r = app.post("/responses", json={"input": "Who's there?", "max_output_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["output"][0]["type"] == "message", r.text
    assert app.get("/models").json() == app.get("/v1/models").json()
    assert app.delete("/chat/completions").status_code == 405


def test_json_schema_without_a_name_is_held(app):
    pytest.importorskip("xgrammar")
    schema = {"type": "array", "items": {"type": "integer", "minimum": 3, "maximum": 7}, "minItems": 2, "maxItems": 2}
    r = app.post("/v1/chat/completions", json={**CHAT, "max_tokens": 40, "response_format": {
        "type": "json_schema", "json_schema": {"schema": schema}}})
    assert r.status_code == 200, r.text
    answer = json.loads(r.json()["choices"][0]["message"]["content"])
    assert len(answer) == 2 and all(isinstance(x, int) and 3 <= x <= 7 for x in answer)


def test_responses_json_schema_needs_a_schema(app):
    r = app.post("/v1/responses", json={"input": "x", "max_output_tokens": 2,
                                         "text": {"format": {"type": "json_schema", "name": "f"}}})
    assert r.status_code == 400, r.text
    assert "schema is required" in r.json()["error"]["message"] and r.json()["error"]["param"].startswith("text")
