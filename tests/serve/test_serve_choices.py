"""n > 1 and best_of, cached-token counts and the prefix-reuse metrics: the app in process around the demo model's
engine (4 slots), talked to with the official openai client. The choices of one request share the prompt's KV (the
first reads it, the others copy its columns: Request.reused); a seeded choice i samples as an n = 1 request with seed
+ i would."""

from pathlib import Path

import openai
import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

import moeserve
from moeserve.engine.batching import ContinuousBatch
from moeserve.serve.app import ServerState, build_app
from moeserve.serve.batcher import Engine
from moeserve.serve.chat_template import ChatTemplate
from moeserve.serve.metrics import Metrics
from moeserve.serve.protocol import MAX_CHOICES
from moeserve.tokenizer import load_tokenizer
from single_thread import one_thread  # noqa: F401 - autouse fixture

TEXT = (Path(moeserve.DEMO_MODEL) / "heldout.txt").read_text()
SLOTS, QUEUE = 4, 8


@pytest.fixture(scope="module")
def served():
    """(engine, the app's test client, jobs): every job the app submits is appended to jobs."""
    model, tok = moeserve.load_model(moeserve.DEMO_MODEL, dtype=torch.float32), load_tokenizer(moeserve.DEMO_MODEL)
    engine = Engine(ContinuousBatch(model, tok, slots=SLOTS, context=512), Metrics("demo", SLOTS), max_queue=QUEUE,
                    threads=1)
    jobs = []
    submit = engine.submit_many
    engine.submit_many = lambda *args: jobs.extend(submit(*args)) or jobs[-len(args[1]):]
    engine.start()
    state = ServerState(tok, ChatTemplate.from_dir(moeserve.DEMO_MODEL), "demo", 512, 258, Metrics("demo", SLOTS),
                        engine=engine)
    yield engine, TestClient(build_app(state)), jobs
    engine.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=served[1], max_retries=0)


def prompt(i: int) -> str:
    """A prompt of ~100 tokens no other test sends."""
    return TEXT[1000 + 300 * i:1100 + 300 * i]


def test_n_choices_share_the_prompt_and_repeat_their_seeds(served, client):
    """Chat with n = 3, seeded: choices 0..2, each what an n = 1 request with seed + i gives; the later choices copy
    the prompt's KV from the first (only its last token computed); usage counts every choice's tokens, the prompt
    once, and the prompt tokens all choices reused as cached."""
    _, _, jobs = served
    messages = [{"role": "user", "content": prompt(0)}]
    kw = dict(model="demo", messages=messages, max_tokens=6, temperature=1.0, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(n=3, seed=7, **kw)
    choices = jobs[-3:]
    assert [c.index for c in r.choices] == [0, 1, 2] and all(c.finish_reason == "length" for c in r.choices)
    ids = choices[0].request.prompt_ids
    assert [j.request.reused for j in choices[1:]] == [len(ids) - 1] * 2  # read once, copied twice
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 18
    assert r.usage.prompt_tokens_details.cached_tokens == min(j.request.reused for j in choices)
    alone = [client.chat.completions.create(seed=7 + i, **kw).choices[0].message.content for i in range(3)]
    assert [c.message.content for c in r.choices] == alone and len(set(alone)) == 3
    again = client.chat.completions.create(n=3, seed=7, **kw)
    assert [c.message.content for c in again.choices] == alone
    assert again.usage.prompt_tokens_details.cached_tokens == len(ids) - 1  # the kept rows hold the whole prompt


def test_n_choices_stream_interleaved_with_one_usage_chunk(client):
    kw = dict(model="demo", prompt=prompt(1), max_tokens=8, temperature=0.9, seed=3, n=2,
              extra_body={"ignore_eos": True}, logprobs=1)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    texts, offsets = {0: "", 1: ""}, {0: [], 1: []}
    for c in chunks[:-1]:
        (choice,) = c.choices
        texts[choice.index] += choice.text
        offsets[choice.index] += choice.logprobs.text_offset if choice.logprobs else []
    assert [texts[0], texts[1]] == [c.text for c in whole.choices] and texts[0] != texts[1]
    assert {c.choices[0].index for c in chunks[:-1][:4]} == {0, 1}  # interleaved as the tokens come
    assert offsets[1] == whole.choices[1].logprobs.text_offset == list(range(8))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16 == whole.usage.completion_tokens
    assert sum(c.usage is not None for c in chunks) == 1


def test_best_of_answers_the_n_of_highest_cumulative_logprob(client):
    kw = dict(model="demo", prompt=prompt(2), max_tokens=6, temperature=1.2, seed=11, extra_body={"ignore_eos": True})
    every = client.completions.create(n=4, logprobs=0, **kw)
    ranked = sorted(every.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    best = client.completions.create(n=2, best_of=4, **kw)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]] and [c.index for c in best.choices] == [0, 1]
    assert all(c.logprobs is None for c in best.choices)  # not asked for: used to rank alone
    assert best.usage.completion_tokens == 24  # every candidate's tokens
    shown = client.completions.create(n=1, best_of=4, logprobs=2, **kw).choices[0]
    assert shown.text == ranked[0].text and len(shown.logprobs.top_logprobs[0]) == 2


@pytest.mark.parametrize("body,message,param", [
    ({"n": MAX_CHOICES + 1}, f"must be in [1, {MAX_CHOICES}]", "n"),
    ({"n": 0}, f"must be in [1, {MAX_CHOICES}]", "n"),
    ({"n": SLOTS + QUEUE + 1}, "more than this server holds at once", "n"),
    ({"n": 2, "best_of": 1}, "best_of (1) must be at least n (2)", None),
    ({"best_of": 3, "stream": True}, "best_of cannot be combined with stream", None),
    ({"best_of": SLOTS + QUEUE + 1}, "best_of = 13 is more than this server holds", "best_of"),
])
def test_choice_limits_are_400s(served, body, message, param):
    r = served[1].post("/v1/completions", json={"prompt": "KING.", "max_tokens": 2, **body})
    assert r.status_code == 400 and message in r.json()["error"]["message"] and r.json()["error"]["param"] == param
    if "best_of" not in body:
        r = served[1].post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], **body})
        assert r.status_code == 400 and message in r.json()["error"]["message"]


def counters(engine) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(engine.metrics.exposition().decode())
            for s in f.samples if s.name.startswith("moeserve:prompt_tokens")}


def test_cached_tokens_and_the_prefix_reuse_metrics(served, client):
    """A repeated prompt reads all but its last token from the kept row: usage says so (completions, chat, the
    Responses API) and the engine's counters add up to the hit rate."""
    engine, http, _ = served
    before = counters(engine)
    text = prompt(3)
    first, second = (client.completions.create(model="demo", prompt=text, max_tokens=2, temperature=0)
                     for _ in range(2))
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens < n - 1
    assert second.usage.prompt_tokens_details.cached_tokens == n - 1
    after = counters(engine)
    cached = after["moeserve:prompt_tokens_cached_total"] - before["moeserve:prompt_tokens_cached_total"]
    assert after["moeserve:prompt_tokens_total"] - before["moeserve:prompt_tokens_total"] == 2 * n
    assert cached == first.usage.prompt_tokens_details.cached_tokens + n - 1
    responses = [http.post("/v1/responses", json={"input": prompt(4), "max_output_tokens": 2}).json()["usage"]
                 for _ in range(2)]
    assert responses[1]["input_tokens_details"]["cached_tokens"] == responses[1]["input_tokens"] - 1
    chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": prompt(4)}],
                                          max_tokens=2)
    assert chat.usage.prompt_tokens_details.cached_tokens == chat.usage.prompt_tokens - 1
