"""The app before its engine exists (the model still loading), in process: /health and requests answer 503, while
bad requests are still told what is wrong with them."""

from fastapi.testclient import TestClient

import moeserve
from moeserve.serve.app import ServerState, build_app
from moeserve.serve.chat_template import ChatTemplate
from moeserve.serve.metrics import Metrics
from moeserve.tokenizer import load_tokenizer


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
