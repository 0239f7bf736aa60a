"""`moeserve serve` over HTTP: the demo model on the CPU, talked to with the official `openai` client and raw httpx.

One server for the module (8 slots, 48-token prefill chunks so longer prompts are read in pieces, a queue of 16,
metrics on). Every request has a timeout and every loop a bound; only 127.0.0.1 is used."""

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import moeserve
from moeserve.engine.generate import generate
from moeserve.engine.params import SamplingParams
from moeserve.serve.process import ServerProcess
from moeserve.tokenizer import load_tokenizer
from single_thread import one_thread  # noqa: F401 - autouse fixture

TIMEOUT = httpx.Timeout(120.0)
TEXT = (Path(moeserve.DEMO_MODEL) / "heldout.txt").read_text()


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--threads", "1", "--parallel", "8", "--max-queue", "16", "--prefill-chunk", "48",
                       "--metrics") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120.0, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def demo():
    return moeserve.load_model(moeserve.DEMO_MODEL, dtype=torch.float32), load_tokenizer(moeserve.DEMO_MODEL)


def alone(demo, prompt: str, max_tokens: int, **kw) -> str:
    model, tok = demo
    params = SamplingParams(max_new_tokens=max_tokens, **{"temperature": 0.0, **kw})
    return generate(model, [tok.encode(prompt)], params, tokenizer=tok)[0].text


def metrics(http) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics: (name, sorted labels without model_name) -> value."""
    out = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            out[s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))] = s.value
    return out


def sse_events(lines) -> list:
    """The JSON payloads of a server-sent event stream, up to `data: [DONE]` (which must come last)."""
    events = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        if line == "data: [DONE]":
            return events
        events.append(json.loads(line.removeprefix("data: ")))
    raise AssertionError("the stream ended without data: [DONE]")


def test_health_and_models(http):
    assert http.get("/health").json() == {"status": "ok"}
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["demo"] and models["data"][0]["max_model_len"] == 512


def test_greedy_completion_equals_moeserve_generate(client):
    prompt = "HAMLET. To be, or not to be"
    env = {**os.environ, "PYTHONPATH": str(Path(moeserve.__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    cli = subprocess.run([sys.executable, "-m", "moeserve", "generate", prompt, "--greedy", "--max-new-tokens", "40",
                          "--no-stream"], capture_output=True, text=True, timeout=300, env=env)
    assert cli.returncode == 0, cli.stderr
    header, printed = cli.stdout.split("\n", 1)
    assert header == "--- [0] (length)"
    r = client.completions.create(model="demo", prompt=prompt, max_tokens=40, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 40
    assert prompt + r.choices[0].text + "\n" == printed
    assert r.usage.prompt_tokens == len(prompt.encode()) + 1  # bytes + BOS


def test_explicit_none_from_the_openai_client_is_the_default(client, demo):
    """The openai client sends null for a parameter given as None; the answer is the one without it."""
    none = dict(top_p=None, n=None, presence_penalty=None, frequency_penalty=None, stop=None, seed=None, user=None,
                logit_bias=None)
    r = client.completions.create(model="demo", prompt="KING.", max_tokens=12, temperature=0, echo=None, **none)
    assert r.choices[0].text == alone(demo, "KING.", 12)
    assert r.system_fingerprint.startswith("moeserve-")
    chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=None, top_logprobs=None, tools=None,
                                          tool_choice=None, response_format=None, stream=None, **none)
    assert chat.usage.completion_tokens == 4 and chat.choices[0].message.tool_calls is None
    assert chat.system_fingerprint == r.system_fingerprint


def test_streamed_completion_equals_whole_one(client, demo):
    prompt, kw = "KING.", dict(model="demo", max_tokens=30, temperature=0)
    whole = client.completions.create(prompt=prompt, **kw)
    chunks = list(client.completions.create(prompt=prompt, stream=True, **kw))
    assert len({c.id for c in chunks}) == 1 and chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text == alone(demo, prompt, 30)


def test_chat_whole_and_streamed(client, http):
    messages = [{"role": "system", "content": "A room in the castle."}, {"role": "user", "content": "Who's there?"}]
    whole = client.chat.completions.create(model="demo", messages=messages, max_tokens=25, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="demo", messages=messages, max_tokens=25, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 25 == whole.usage.completion_tokens
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == whole.choices[0].message.content
    # the prompt is the fallback template's rendering: speaker headings as in the demo's plays, and a BOS
    tokens = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert bytes(tokens[1:]).decode() == "[A room in the castle.]\n\nUser.\nWho's there?\n\nAssistant.\n"
    assert whole.usage.prompt_tokens == len(tokens)


def test_sixteen_concurrent_streams_each_get_their_solo_text(server, demo):
    """16 streaming clients at once (8 decoding, 8 queued, prompts of 1 to 151 tokens, 8 to 38 new tokens),
    raw SSE over httpx: all finish, each with exactly the text its prompt gets alone."""
    prompts = [TEXT[211 * i: 211 * i + 10 * i] for i in range(16)]
    lengths = [8 + 2 * i for i in range(16)]

    async def one(c: httpx.AsyncClient, prompt: str, n: int) -> str:
        body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = sse_events([line async for line in r.aiter_lines()])
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        return "".join(e["choices"][0]["text"] for e in events)

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as c:
            return await asyncio.wait_for(asyncio.gather(*(one(c, p, n) for p, n in zip(prompts, lengths))), 300)

    texts = asyncio.run(main())
    for prompt, n, text in zip(prompts, lengths, texts):
        assert text == alone(demo, prompt, n)


def test_seeded_sampling_stop_strings_and_token_prompts(client, demo):
    kw = dict(model="demo", max_tokens=40, temperature=0.9, top_p=0.95, seed=7)
    a, b = (client.completions.create(prompt="QUEEN.", **kw).choices[0].text for _ in range(2))
    assert a == b == alone(demo, "QUEEN.", 40, temperature=0.9, top_p=0.95, seed=7)
    stop = a[5:8]
    r = client.completions.create(prompt="QUEEN.", stop=[stop], **kw).choices[0]
    assert r.finish_reason == "stop" and r.text == a[:a.index(stop)]
    ids = [256, *b"QUEEN."]  # a prompt of token ids: the same tokens as the text with its BOS
    assert client.completions.create(prompt=ids, **kw).choices[0].text == a


def test_logprobs_shapes(client):
    c = client.completions.create(model="demo", prompt="ROMEO.", max_tokens=5, temperature=0, logprobs=3)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == c.choices[0].text and lp.text_offset == [0, 1, 2, 3, 4]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and len(top) <= 3 and max(top.values()) == pytest.approx(value) and top[token] == value
    chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and "".join(e.token for e in content) == chat.choices[0].message.content
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == pytest.approx(e.logprob) for e in content)
    assert all(e.bytes == list(e.token.encode()) for e in content)


@pytest.mark.parametrize("body,status,message", [
    (b'{"prompt": "x", "max_tokens": ', 400, "not valid JSON"),
    (b'["x"]', 400, "JSON object"),
    (b'{"prompt": "x", "max_tokens": "5"}', 400, "max_tokens: Input should be a valid integer"),
    (b'{"prompt": "x", "max_tokens": -1}', 400, "max_tokens: Input should be greater than or equal to 1"),
    (b'{"prompt": "x", "temperature": "hot"}', 400, "temperature"),
    (b'{"prompt": "x", "stream": 1}', 400, "stream: Input should be a valid boolean"),
    (b'{"prompt": 5}', 400, "prompt"),
    (b'{"prompt": "x", "n": 17}', 400, "n: must be in [1, 16]"),
    (b'{"prompt": "x", "seed": -1}', 400, "seed"),
    (b'{"prompt": "x", "stop": [""]}', 400, "stop strings must not be empty"),
    (b'{"prompt": [300]}', 400, "vocabulary"),
    (('{"prompt": "%s"}' % ("x" * 600)).encode(), 400, "maximum context length is 512 tokens"),
    (b'{"prompt": "x", "model": "gpt-4"}', 404, "The model `gpt-4` does not exist"),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(http, body, status, message):
    r = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status
    error = r.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error" and "code" in error
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_chat_errors(http):
    bad = [({"messages": []}, "messages"), ({"messages": [{"role": "king", "content": "x"}]}, "messages.0.role"),
           ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs needs logprobs")]
    for body, message in bad:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and message in r.json()["error"]["message"]
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_metrics_count_what_was_sent(http):
    before = metrics(http)
    sent = [("ab", 3), ("Enter the Ghost.", 7), ("Exit.", 1)]
    usages = [http.post("/v1/completions", json={"prompt": p, "max_tokens": n, "temperature": 0}).json()["usage"]
              for p, n in sent]
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 0}).status_code == 400
    after = metrics(http)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert delta("moeserve:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages) == 3 + 17 + 6
    assert delta("moeserve:generation_tokens_total") == sum(u["completion_tokens"] for u in usages) == 11
    assert delta("moeserve:request_success_total", finished_reason="length") == 3
    assert delta("moeserve:request_errors_total", status="400") == 1
    assert delta("moeserve:time_to_first_token_seconds_count") == 3
    assert delta("moeserve:inter_token_latency_seconds_count") == 11 - 3
    assert after["moeserve:kv_slots_total", ()] == 8 and after["moeserve:kv_slots_used", ()] == 0
    assert after["moeserve:num_requests_running", ()] == 0 and after["moeserve:num_requests_waiting", ()] == 0


def test_tokenize_detokenize_round_trip(http):
    text = "To be, or not to be: that is the question — ay."
    tokens = http.post("/tokenize", json={"prompt": text}).json()
    assert tokens["tokens"][0] == 256 and tokens["count"] == len(text.encode()) + 1 and tokens["max_model_len"] == 512
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": text}
    no_bos = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert no_bos == tokens["tokens"][1:]
    r = http.post("/detokenize", json={"tokens": [1, 999]})
    assert r.status_code == 400 and "tokens" in r.json()["error"]["message"]


def test_a_non_streaming_client_that_goes_away_is_dropped(server, http):
    """No stream to write to: the handler polls for the disconnect and frees the slot (abort counted)."""
    aborted = ("moeserve:request_success_total", (("finished_reason", "abort"),))
    before = metrics(http).get(aborted, 0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json={"prompt": "KING.", "max_tokens": 500, "ignore_eos": True},
                   timeout=0.3)
    deadline = time.monotonic() + 30
    while metrics(http).get(aborted, 0) == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metrics(http).get(aborted, 0) == before + 1 and metrics(http)["moeserve:kv_slots_used", ()] == 0


def test_structured_output_over_http(client):
    """A real server holds a JSON schema (the grammar built on the first request that needs one), streamed too."""
    pytest.importorskip("xgrammar")
    import jsonschema

    schema = {"type": "object", "properties": {"speaker": {"type": "string", "maxLength": 10},
                                               "act": {"type": "integer", "minimum": 1, "maximum": 5}},
              "required": ["speaker", "act"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "line", "schema": schema, "strict": True}}
    kw = dict(model="demo", messages=[{"role": "user", "content": "Who speaks?"}], max_tokens=200, temperature=0.8,
              seed=4, response_format=fmt)
    r = client.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw))
    assert streamed == r.choices[0].message.content
